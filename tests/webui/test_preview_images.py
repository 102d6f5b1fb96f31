"""The data preview shows each image row's pictures next to its tokens: small PNG thumbnails inside
the preview JSON, read only from inside the config's dataset_dir."""

from __future__ import annotations

import base64
import io
import json
import os

import pytest
from PIL import Image

from cluster.webui.preview import THUMBNAIL_SIDE, preview, thumbnail

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA_DIR = os.path.join(REPO_ROOT, "data")


def llava_config(dataset_dir=DATA_DIR, dataset="shapes_train") -> dict:
    return {"model_name_or_path": "tiny:llava", "template": "llava", "stage": "sft", "dataset": dataset,
            "dataset_dir": str(dataset_dir), "cutoff_len": 128, "output_dir": "x"}


def decoded(entry: dict) -> Image.Image:
    prefix = "data:image/png;base64,"
    assert entry["data_url"].startswith(prefix)
    image = Image.open(io.BytesIO(base64.b64decode(entry["data_url"][len(prefix):])))
    image.load()
    return image


def test_an_image_row_carries_its_picture_and_a_text_row_none():
    shown = preview(llava_config(), "shapes_train", rows=2)
    assert len(shown["images"]) == len(shown["rows"]) == 2
    with open(os.path.join(DATA_DIR, "shapes_train.json"), encoding="utf-8") as f:
        first_two = json.load(f)[:2]
    for images, row in zip(shown["images"], first_two):
        (entry,) = images
        assert entry["name"] == os.path.basename(row["images"][0])
        picture = decoded(entry)
        assert picture.format == "PNG" and picture.size == (64, 64) == (entry["width"], entry["height"])
        with Image.open(os.path.join(DATA_DIR, row["images"][0])) as original:
            # a 64-pixel picture is shown as it is, pixel for pixel
            assert picture.convert("RGB").tobytes() == original.convert("RGB").tobytes()
    # and the row's tokens hold the plugin's <image> run next to it
    assert any(t["text"] == "<image>" for t in shown["rows"][0][0]["tokens"])

    text = preview(llava_config(), "identity", rows=2)
    assert text["images"] == [[], []] and len(text["rows"]) == 2


def write_dataset(folder, images: list[str]) -> None:
    rows = [{"messages": [{"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": "a"}],
             "images": [path]} for path in images]
    (folder / "pics.json").write_text(json.dumps(rows), encoding="utf-8")
    info = {"pics": {"file_name": "pics.json", "formatting": "sharegpt",
                     "columns": {"messages": "messages", "images": "images"},
                     "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                              "assistant_tag": "assistant"}}}
    (folder / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")


def test_large_pictures_shrink_to_the_thumbnail_side_keeping_their_shape(tmp_path):
    Image.new("RGB", (600, 300), "red").save(tmp_path / "wide.png")
    shown = thumbnail(str(tmp_path / "wide.png"), str(tmp_path))
    assert decoded(shown).size == (THUMBNAIL_SIDE, THUMBNAIL_SIDE // 2)


def test_files_outside_dataset_dir_are_never_read(tmp_path):
    """A row may name any file (``..``, an absolute path, a symlink out): the preview shows none of
    them, only that they are not shown."""
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (40, 40), "blue").save(tmp_path / "secret.png")
    Image.new("RGB", (40, 40), "green").save(data / "inside.png")
    os.symlink(tmp_path / "secret.png", data / "link.png")
    write_dataset(data, ["inside.png", "../secret.png", str(tmp_path / "secret.png"), "link.png"])
    shown = preview(llava_config(data, "pics"), "pics", rows=4)
    inside, dotdot, absolute, link = [images[0] for images in shown["images"]]
    assert decoded(inside).size == (40, 40)
    for entry in (dotdot, absolute, link):
        assert "data_url" not in entry and "outside dataset_dir" in entry["error"], entry


def test_what_is_no_picture_is_reported_not_raised(tmp_path):
    (tmp_path / "fake.png").write_bytes(b"not a png")
    shown = thumbnail(str(tmp_path / "fake.png"), str(tmp_path))
    assert "data_url" not in shown and "cannot be read" in shown["error"]


def test_the_api_preview_answers_with_the_thumbnails(tmp_path):
    from fastapi.testclient import TestClient

    from cluster.webui.server import create_app

    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (40, 40), "green").save(data / "inside.png")
    write_dataset(data, ["inside.png"])
    client = TestClient(create_app(str(tmp_path / "share"), cwd=str(tmp_path)), base_url="http://127.0.0.1:7860")
    values = {"model_name_or_path": "tiny:llava", "template": "llava", "stage": "sft", "dataset": "pics",
              "dataset_dir": "data", "cutoff_len": "128", "output_dir": "saves/x", "finetuning_type": "full"}
    answer = client.post("/api/preview", json={"values": values, "extra_text": "", "dataset": "pics", "rows": 1})
    assert answer.status_code == 200, answer.text
    (entry,) = answer.json()["images"][0]
    assert decoded(entry).size == (40, 40)


@pytest.mark.parametrize("path", ["../secret.png", "/etc/passwd"])
def test_thumbnail_refuses_paths_outside_its_root(tmp_path, path):
    root = tmp_path / "data"
    root.mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "secret.png")
    shown = thumbnail(str(root / path) if not os.path.isabs(path) else path, str(root))
    assert "data_url" not in shown and "outside" in shown["error"]


def test_the_page_shows_an_image_rows_picture_beside_its_tokens(webui, browser):
    """In the browser: the thumbnail is an <img> the page decoded (its natural size is the picture's),
    next to the row's tokens; a text dataset's rows have no picture."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    from tests.webui.test_webui import fill_tiny_sft, open_board, shot, wait_for

    url, _, _ = webui
    open_board(browser, url)
    fill_tiny_sft(browser, "saves/preview-images", model_name_or_path="tiny:llava", template="llava",
                  dataset=["shapes_train"], cutoff_len=128)
    Select(browser.find_element(By.ID, "preview-dataset")).select_by_value("shapes_train")
    browser.find_element(By.ID, "preview-run").click()
    images = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#preview .preview-row .preview-images img"),
                      what="the preview's pictures")
    assert len(images) == 3  # SHOWN_ROWS rows, one picture each
    assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", images[0]) == 64
    row = browser.find_elements(By.CSS_SELECTOR, "#preview .preview-row")[0]
    assert row.find_elements(By.CSS_SELECTOR, ".preview-body .tok")  # the tokens sit beside the picture
    shot(browser, "train-preview-images")

    Select(browser.find_element(By.ID, "preview-dataset")).select_by_value("identity")
    browser.find_element(By.ID, "preview-run").click()
    wait_for(lambda: "identity" in browser.find_element(By.ID, "preview-stats").text, what="the text preview")
    assert browser.find_elements(By.CSS_SELECTOR, "#preview .preview-row")
    assert not browser.find_elements(By.CSS_SELECTOR, "#preview img")
