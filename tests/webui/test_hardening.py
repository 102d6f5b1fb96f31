"""The web UI against a hostile caller (issue 37), without a browser: paths stay in the UI's folders,
the Host and Origin a browser sends are checked, the token compares bytes, and no request body,
however wrong, gets a 500."""

from __future__ import annotations

import json
import os
import random

import pytest

from registries.errors import UserError

BASE_URL = "http://127.0.0.1:7860"  # the Host and Origin a browser on the page sends
POST_ROUTES = ("/api/config", "/api/yaml/load", "/api/yaml/save", "/api/preview", "/api/runs", "/api/chat",
               "/api/export")
FUZZ_BODIES = 300
OUTSIDE = "outside the folders"


@pytest.fixture
def ui(tmp_path):
    """(client, cwd, share, outside): a UI running in ``cwd``, and a folder beside it with a secret
    YAML, a secret text file, and symlinks to both inside cwd."""
    from fastapi.testclient import TestClient

    from cluster.webui.server import create_app

    cwd, outside = tmp_path / "cwd", tmp_path / "outside"
    cwd.mkdir()
    outside.mkdir()
    (outside / "secret.yaml").write_text("secret_key: do-not-show\n")
    (outside / "secret.txt").write_text("secret_key: do-not-show\n")
    (cwd / "link.yaml").symlink_to(outside / "secret.yaml")
    (cwd / "linkdir").symlink_to(outside)
    (cwd / "notes.txt").write_text("lora_rank: 4\n")
    (cwd / "notes-link.yaml").symlink_to(cwd / "notes.txt")
    share = cwd / "share"
    client = TestClient(create_app(str(share), cwd=str(cwd)), base_url=BASE_URL, raise_server_exceptions=False)
    return client, cwd, share, outside


def refused(answer, *words):
    assert answer.status_code == 400, (answer.status_code, answer.text)
    error = answer.json()["error"]
    for word in words:
        assert word in error, error
    assert "do-not-show" not in answer.text
    return error


# --- paths ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/etc/passwd", "/etc/shadow", "../outside/secret.yaml", "link.yaml",
                                  "linkdir/secret.yaml", "~/../../etc/passwd"])
def test_yaml_load_refuses_paths_outside_the_ui_folders(ui, path):
    client, cwd, share, _ = ui
    error = refused(client.post("/api/yaml/load", json={"path": path}), OUTSIDE)
    assert str(cwd) in error and str(share) in error  # the message names the allowed folders


@pytest.mark.parametrize("path", ["notes.txt", "notes-link.yaml", "linkdir/secret.txt"])
def test_yaml_load_reads_only_yaml_files(ui, path):
    client, *_ = ui
    refused(client.post("/api/yaml/load", json={"path": path}))


@pytest.mark.parametrize("where", ["absolute", "dotdot", "symlink", "parent"])
def test_yaml_save_refuses_paths_outside_the_ui_folders(ui, where, tmp_path):
    client, cwd, _, outside = ui
    path = {"absolute": str(outside / "new.yaml"), "dotdot": "../outside/new.yaml",
            "symlink": "linkdir/new.yaml", "parent": str(tmp_path / "new.yaml")}[where]
    refused(client.post("/api/yaml/save", json={"values": {}, "path": path}), OUTSIDE)
    assert not os.path.exists(outside / "new.yaml") and not os.path.exists(tmp_path / "new.yaml")


def test_yaml_save_and_load_handle_only_yaml_files_inside_the_folders(ui):
    client, cwd, share, _ = ui
    for name in ("evil.sh", "saved.yaml.sh", ".bashrc", "share/configs/x.json"):
        refused(client.post("/api/yaml/save", json={"values": {}, "path": name}), ".yaml")
        assert not os.path.exists(cwd / name)
    for path in ("configs/a.yaml", str(cwd / "b.yml"), str(share / "c.yaml")):
        saved = client.post("/api/yaml/save", json={"values": {"lora_rank": 16}, "extra_text": "x_key: 1\n",
                                                    "path": path})
        assert saved.status_code == 200, saved.text
        assert os.path.isfile(saved.json()["path"])
        loaded = client.post("/api/yaml/load", json={"path": path})
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["values"]["lora_rank"] == 16 and "x_key: 1" in loaded.json()["extra_text"]
    default = client.post("/api/yaml/save", json={"values": {"output_dir": "saves/x"}})  # no path: the share dir
    assert default.status_code == 200 and default.json()["path"].startswith(str(share)), default.text


def test_config_paths_are_confined_in_every_route(ui, tmp_path):
    client, cwd, _, outside = ui
    (outside / "dataset_info.json").write_text("{}")
    refused(client.get("/api/datasets", params={"dataset_dir": str(outside)}), OUTSIDE)
    refused(client.get("/api/datasets", params={"dataset_dir": "../outside"}), OUTSIDE)
    refused(client.get("/api/datasets", params={"dataset_dir": "linkdir"}), OUTSIDE)
    escapes = [{"values": {"dataset_dir": "../outside"}}, {"values": {"output_dir": "/tmp/x"}},
               {"values": {"model_name_or_path": str(outside)}}, {"values": {"output_dir": "linkdir/run"}},
               {"values": {}, "extra_text": "adapter_name_or_path: ../outside\n"},
               {"values": {}, "extra_text": "adapter_name_or_path: saves/a,/etc\n"}]
    for body in escapes:
        for route in ("/api/preview", "/api/runs", "/api/yaml/save"):
            refused(client.post(route, json={**body, "dataset": "x", "path": "ok.yaml"}), OUTSIDE)
        error = client.post("/api/config", json=body).json()["error"]  # the page shows it by the field
        assert error and OUTSIDE in error["message"], error
    assert not os.path.exists(cwd / "ok.yaml")
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    refused(client.post("/api/chat", json={**chat, "model_name_or_path": "/etc"}), OUTSIDE)
    refused(client.post("/api/chat", json={**chat, "model_name_or_path": "tiny:qwen2",
                                           "adapter_name_or_path": "../outside"}), OUTSIDE)
    refused(client.post("/api/export", json={"model_name_or_path": "./none", "export_dir": "../exported"}), OUTSIDE)
    refused(client.post("/api/export", json={"model_name_or_path": "./none", "export_dir": "linkdir/x"}), OUTSIDE)
    assert not os.path.exists(tmp_path / "exported") and not os.path.exists(outside / "x")
    # hub ids and built-in ids are not paths
    for model in ("org/name", "tiny:qwen2", "demo:smollm2-135m-instruct"):
        error = client.post("/api/config", json={"values": {"model_name_or_path": model}}).json()["error"]
        assert error is None or OUTSIDE not in error["message"], (model, error)


def test_confine_and_is_local(tmp_path):
    from cluster.webui.paths import check_config, confine, is_local

    roots = (str(tmp_path / "cwd"), str(tmp_path / "share"))
    os.makedirs(roots[0])
    assert confine("a/../b", roots) == os.path.join(os.path.realpath(roots[0]), "b")
    assert confine(os.path.join(roots[1], "c.yaml"), roots) == os.path.join(os.path.realpath(roots[1]), "c.yaml")
    for bad in ("/etc/passwd", "..", "../cwd2", "a/../../x", "", None, 5, "a\x00b"):
        with pytest.raises(UserError):
            confine(bad, roots)
    assert not any(is_local(v, roots[0]) for v in ("org/name", "name", "tiny:qwen2", "demo:x", "Org-1/m_2.5"))
    # Only a hub spelling or a built-in id is not a path: a URL, 'a:b', 'org/' are (and get confined).
    assert all(is_local(v, roots[0]) for v in ("/m", "./m", "../m", "~/m", "a/b/c", "a/../b", ".", "https://h/m",
                                               "x://../../outside", "file:///etc", "a:b", "org/", "o..x/m", "a--b"))
    os.makedirs(os.path.join(roots[0], "org", "name"))
    assert is_local("org/name", roots[0])  # a folder under the UI's folder is that folder
    assert check_config({"output_dir": "o", "model_name_or_path": "org/name", "dataset_dir": "d"}, roots) == {
        "output_dir": confine("o", roots), "model_name_or_path": confine("org/name", roots),
        "dataset_dir": confine("d", roots)}


# --- Host, Origin, token ----------------------------------------------------------------------

@pytest.mark.parametrize("route", ["/", "/api/spec", "/static/app.js"])
def test_forged_host_and_origin_are_refused_on_every_route(ui, route):
    client, *_ = ui
    for host in ("evil.example:7860", "evil.example", "127.0.0.1.evil.example", "localhost.evil.example:80", ""):
        answer = client.get(route, headers={"host": host})
        assert answer.status_code == 403 and "Host" in answer.json()["error"], (host, answer.text)
        assert "--allow-host" in answer.json()["error"]
    for origin in ("http://evil.example", "https://evil.example:7860", "null", "file://",
                   "http://127.0.0.1.evil.example"):
        answer = client.get(route, headers={"origin": origin})
        assert answer.status_code == 403 and "Origin" in answer.json()["error"], (origin, answer.text)
    answer = client.post("/api/yaml/save", json={"values": {}, "path": "x.yaml"},
                         headers={"host": "evil.example:7860"})
    assert answer.status_code == 403
    for host in ("127.0.0.1:7860", "LOCALHOST:7860", "[::1]:7860", "localhost:07860"):
        assert client.get(route, headers={"host": host}).status_code == 200, host
    assert client.get(route, headers={"origin": "http://localhost:7860"}).status_code == 200
    # Whole origins: a page on another port of this machine (a notebook, a dev server) is another origin.
    for host in ("localhost:1234", "127.0.0.1", "127.0.0.1:80", "[::1]:8999", "127.0.0.1:x"):
        answer = client.get(route, headers={"host": host})
        assert answer.status_code == 403 and "port 7860" in answer.json()["error"], (host, answer.text)
    for origin in ("http://127.0.0.1:8999", "http://localhost", "https://127.0.0.1:7860", "http://[::1]:8999"):
        answer = client.get(route, headers={"origin": origin})
        assert answer.status_code == 403 and "Origin" in answer.json()["error"], (origin, answer.text)


def test_host_named_by_host_or_allow_host_is_allowed(tmp_path):
    from fastapi.testclient import TestClient

    from cluster.webui.server import create_app

    app = create_app(str(tmp_path / "share"), token="t", cwd=str(tmp_path), host="10.1.2.3",
                     allowed_hosts=["ui.example", "https://proxy.example"])
    client = TestClient(app, base_url="http://10.1.2.3:7860", raise_server_exceptions=False)
    headers = {"x-rayfactory-token": "t"}
    assert client.get("/api/spec", headers=headers).status_code == 200
    assert client.get("/api/spec", headers={**headers, "host": "ui.example:7860",
                                            "origin": "http://ui.example:7860"}).status_code == 200
    assert client.get("/api/spec", headers={**headers, "host": "ui.example:80"}).status_code == 403
    # A whole origin given to --allow-host: a TLS proxy in front, whose Host is its own.
    assert client.get("/api/spec", headers={**headers, "host": "proxy.example",
                                            "origin": "https://proxy.example"}).status_code == 200
    assert client.get("/api/spec", headers={**headers, "host": "proxy.example",
                                            "origin": "https://proxy.example:8443"}).status_code == 403
    assert client.get("/api/spec", headers={**headers, "host": "127.0.0.1:7860"}).status_code == 200
    assert client.get("/api/spec", headers={**headers, "host": "10.1.2.4:7860"}).status_code == 403


def test_token_header_of_any_bytes_is_a_401_never_a_500(tmp_path):
    from fastapi.testclient import TestClient

    from cluster.webui.server import TOKEN_HEADER, create_app

    client = TestClient(create_app(str(tmp_path / "share"), token="s3cret", cwd=str(tmp_path)), base_url=BASE_URL,
                        raise_server_exceptions=False)
    for given in ("sécret".encode("utf-8"), "s3cret\u00ff".encode("latin-1"), b"\xff\xfe", b"s3cre", b"s3cret "):
        answer = client.get("/api/spec", headers={TOKEN_HEADER: given})
        assert answer.status_code == 401, (given, answer.status_code, answer.text)
    assert client.get("/api/spec", headers={TOKEN_HEADER: b"s3cret"}).status_code == 200
    utf8 = TestClient(create_app(str(tmp_path / "share"), token="sécret", cwd=str(tmp_path)), base_url=BASE_URL)
    assert utf8.get("/api/spec", headers={TOKEN_HEADER: "sécret".encode("utf-8")}).status_code == 200


def test_the_real_server_checks_host_and_paths(webui):
    """`rayfactory webui` itself (uvicorn, the CLI's wiring): a rebinding Host and a path outside
    its folder are refused, the page's own requests answered."""
    import urllib.error
    import urllib.request

    url, _, _ = webui

    def call(path, body=None, **headers):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url + path, data=data, headers={"content-type": "application/json",
                                                                         **headers})
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                return answer.status, json.loads(answer.read() or b"null")
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    assert call("/api/spec")[0] == 200
    assert call("/api/spec", Host="evil.example:" + url.rsplit(":", 1)[1])[0] == 403
    assert call("/api/spec", Origin="http://evil.example")[0] == 403
    status, answer = call("/api/yaml/load", {"path": "/etc/passwd"})
    assert status == 400 and OUTSIDE in answer["error"]
    assert call("/api/config", [1])[0] == 400


# --- malformed requests -----------------------------------------------------------------------------

CHAT = {"model_name_or_path": "tiny:qwen2", "messages": [{"role": "user", "content": "hi"}]}
MALFORMED = [  # (route, body, a word the 400's message must hold)
    ("/api/config", {"values": 5}, "values"),
    ("/api/config", {"values": [1, 2]}, "values"),
    ("/api/config", {"values": {"lora_rank": {"a": 1}}}, "lora_rank"),
    ("/api/config", {"values": {"dataset": [1, 2]}}, "dataset"),
    ("/api/config", {"values": {}, "extra_text": 7}, "extra_text"),
    ("/api/yaml/save", {"values": "x", "path": "a.yaml"}, "values"),
    ("/api/yaml/save", {"values": {}, "path": ["a.yaml"]}, "path"),
    ("/api/yaml/load", {"path": 5}, "path"),
    ("/api/yaml/load", {"text": {"a": 1}}, "text"),
    ("/api/preview", {"values": {}, "dataset": "arith_train", "rows": "abc"}, "rows"),
    ("/api/preview", {"values": {}, "dataset": "arith_train", "rows": 0}, "rows must be"),
    ("/api/preview", {"values": {}, "dataset": "arith_train", "rows": 51}, "rows"),
    ("/api/preview", {"values": {}, "dataset": "arith_train", "rows": 1.5}, "rows"),
    ("/api/preview", {"values": {}, "dataset": "arith_train", "rows": True}, "rows"),
    ("/api/preview", {"values": {}, "dataset": ["arith_train"]}, "dataset must be a string"),
    ("/api/preview", {"values": {}}, "dataset"),
    ("/api/runs", {"values": 5}, "values"),
    ("/api/chat", {**CHAT, "max_new_tokens": "abc"}, "max_new_tokens"),
    ("/api/chat", {**CHAT, "max_new_tokens": 0}, "max_new_tokens"),
    ("/api/chat", {**CHAT, "max_new_tokens": 10**9}, "max_new_tokens"),
    ("/api/chat", {**CHAT, "max_new_tokens": 10**400}, "max_new_tokens"),
    ("/api/chat", {**CHAT, "temperature": "hot"}, "temperature"),
    ("/api/chat", {**CHAT, "temperature": -1}, "temperature"),
    ("/api/chat", {**CHAT, "top_p": 2}, "top_p"),
    ("/api/chat", {**CHAT, "temperature": float("nan")}, "temperature"),
    ("/api/chat", {**CHAT, "messages": "hi"}, "messages"),
    ("/api/chat", {**CHAT, "messages": []}, "messages"),
    ("/api/chat", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages"),
    ("/api/chat", {**CHAT, "messages": [{"role": "root", "content": "x"}]}, "messages"),
    ("/api/chat", {**CHAT, "messages": ["hi"]}, "messages"),
    ("/api/chat", {**CHAT, "model_name_or_path": ["a"]}, "model_name_or_path"),
    ("/api/chat", {**CHAT, "system": 5}, "system"),
    ("/api/export", {"model_name_or_path": "./none", "export_dir": "out", "export_size": "big"}, "export_size"),
    ("/api/export", {"model_name_or_path": "./none", "export_dir": 5}, "export_dir"),
]


@pytest.mark.parametrize("route,body,word", MALFORMED, ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(MALFORMED)])
def test_malformed_bodies_get_a_400_that_names_the_mistake(ui, route, body, word):
    client, *_ = ui
    answer = client.post(route, content=json.dumps(body), headers={"content-type": "application/json"})
    assert answer.status_code == 400, (answer.status_code, answer.text)
    assert word in answer.json()["error"], answer.json()["error"]


@pytest.mark.parametrize("route", POST_ROUTES)
def test_a_body_that_is_not_a_json_object_gets_a_400(ui, route):
    client, *_ = ui
    for raw in (b"[1, 2]", b'"text"', b"5", b"null", b"", b"{", b"\xff\xfe", b"[" * 100_000, b'{"a": 1e999}' * 2):
        answer = client.post(route, content=raw, headers={"content-type": "application/json"})
        assert answer.status_code == 400, (raw[:20], answer.status_code, answer.text)
        assert "JSON object" in answer.json()["error"]


def test_yaml_box_with_aliases_dates_or_nan_is_a_client_mistake(ui):
    client, *_ = ui
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: [*b, *b, *b, *b, *b]\n"
    for text in (bomb, "x: .nan\n", "x: 2024-01-01\n", "x: !!binary /w==\n", "1: 2\n", "[" * 5000):
        answer = client.post("/api/yaml/load", json={"text": text})
        assert answer.status_code == 400, (text[:30], answer.text)
        config = client.post("/api/config", json={"values": {}, "extra_text": text})
        assert config.status_code == 200 and config.json()["error"]["key"] == "extra", config.text


def _fuzz_value(rng: random.Random, depth: int = 0):
    strings = ["", "abc", "../../etc/passwd", "/etc/shadow", "~/.ssh/id_rsa", "linkdir/x.yaml", "a.yaml",
               "é\u202e\x00", "x" * 5000, "1e999", "nan", "-1", "0", "50", "user", "assistant", "lora",
               "sft", "*a", "&a x", "{", "tiny:nope", "demo:nope", "./none", "./a\x00b", "~nobody/x"]
    kind = rng.randrange(10 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 3, 51, 2**63, -(2**70), 10**300, 10**400])
    if kind == 3:
        return rng.choice([0.5, -0.0, 1e308, float("nan"), float("inf"), -float("inf"), 1e-320])
    if kind in (4, 5):
        return rng.choice(strings)
    if kind in (6, 7):
        return [_fuzz_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["role", "content", "a", "CPU", "dataset", "lora_rank", "values"]
    return {rng.choice(keys): _fuzz_value(rng, depth + 1) for _ in range(rng.randrange(4))}


FUZZ_KEYS = ["values", "extra_text", "path", "text", "dataset", "rows", "messages", "system", "temperature", "top_p",
             "max_new_tokens", "model_name_or_path", "adapter_name_or_path", "template", "export_dir", "export_size",
             "junk"]
# A well-formed body of each route, which the fuzz mutates (a model never loads: ./none does not exist).
FUZZ_BASES = {
    "/api/config": {"values": {"lora_rank": 8, "dataset": ["a"]}, "extra_text": "do_train: true\n"},
    "/api/yaml/load": {"text": "lora_rank: 4\n"},
    "/api/yaml/save": {"values": {"lora_rank": 8}, "path": "a.yaml"},
    "/api/preview": {"values": {"template": "qwen"}, "dataset": "arith_train", "rows": 3},
    # A dataset no dataset_info.json names: validation refuses it, so no fuzzed body starts a training job.
    "/api/runs": {"values": {"dataset": ["no_such_dataset"]}},
    "/api/chat": {"model_name_or_path": "./none", "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
                  "max_new_tokens": 8, "top_p": 1},
    "/api/export": {"model_name_or_path": "./none", "export_dir": "out", "export_size": 1},
}


def _fuzz_body(rng: random.Random, route: str) -> bytes:
    """Raw garbage, a random JSON value, or the route's well-formed body with one to three keys
    (or form fields, or message parts) replaced by random and adversarial values."""
    from cluster.webui.form import FIELDS

    roll = rng.random()
    if roll < 0.1:
        return rng.choice([b"[]", b"1", b'"x"', b"null", b"{", b"\x00\xff", b"{}" * 3, b"[" * 3000 + b"]" * 3000])
    if roll < 0.2:
        return json.dumps(_fuzz_value(rng)).encode()
    body = json.loads(json.dumps(FUZZ_BASES[route]))
    for _ in range(rng.randrange(1, 4)):
        key = rng.choice(FUZZ_KEYS + list(body))
        if key == "values" and rng.random() < 0.7:
            body["values"] = dict(body.get("values") or {}) if isinstance(body.get("values"), dict) else {}
            body["values"][rng.choice([f.key for f in FIELDS])] = _fuzz_value(rng, 1)
        elif key == "messages" and rng.random() < 0.7:
            body[key] = [{"role": rng.choice(["user", "assistant", "system", "function", "x", 5]),
                          "content": _fuzz_value(rng, 2)} for _ in range(rng.randrange(4))]
        elif key == "extra_text" and rng.random() < 0.7:
            body[key] = rng.choice(["a: 1\n", "- 1\n", "a: [\n", "x: .inf\n", "dataset_dir: /etc\n",
                                    "output_dir: ../x\n", "k: &a 1\nj: *a\n", "a: !!python/object:os.system x\n",
                                    "resources_per_worker: [1]\n", "lora_rank: {a: 1}\n", "stage: [1]\n",
                                    "deepspeed: /etc/passwd\n", "model_name_or_path: ~/m\n"])
        else:
            body[key] = _fuzz_value(rng)
    for keys in (body, body.get("values")):  # model keys: never a hub id (nothing is downloaded here)
        for key in ("model_name_or_path", "adapter_name_or_path"):
            if isinstance(keys, dict) and isinstance(keys.get(key), str) and not keys[key].startswith(
                    ("/", ".", "~", "tiny:", "demo:")):
                keys[key] = "./none"
    return json.dumps(body, allow_nan=True).encode()


def test_fuzzed_bodies_never_get_a_500_and_the_server_keeps_answering(ui):
    """FUZZ_BODIES seeded random and adversarial bodies to each POST route. No model loads: the
    model values it draws are local paths that do not exist or unknown built-in ids, never a hub id."""
    client, cwd, *_ = ui
    rng = random.Random(37)
    failures = []
    for route in POST_ROUTES:
        for _ in range(FUZZ_BODIES):
            raw = _fuzz_body(rng, route)
            answer = client.post(route, content=raw, headers={"content-type": "application/json"})
            if answer.status_code >= 500:
                failures.append((route, raw[:200], answer.status_code, answer.text[:300]))
    assert not failures, f"{len(failures)} bodies got a 5xx, the first ones: {failures[:5]}"
    spec = client.get("/api/spec")
    assert spec.status_code == 200 and spec.json()["fields"]
    assert client.get("/api/runs").json()["runs"] == []
    assert not any(os.path.lexists(os.path.join(cwd, "..", name)) for name in ("x", "x.yaml", "a.yaml"))
