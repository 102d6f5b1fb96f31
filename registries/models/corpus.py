"""The built-in text the tiny tokenizers are trained on.

Small (a few hundred KB) and generated in a fixed order, so the trained vocabulary is the
same on every machine. It covers common English words, chat-like turns and arithmetic in
the shape our synthetic tasks use, so that those texts encode into short sequences and every
number is spelled digit by digit (the pre-tokenizer isolates digits).
"""

from __future__ import annotations

from typing import Iterator

_WORDS = """
the of and to in is it you that he was for on are with as his they be at one have this from or had by
word but what some we can out other were all there when up use your how said an each she which do their
time if will way about many then them write would like so these her long make thing see him two has look
more day could go come did number sound no most people my over know water than call first who may down
side been now find any new work part take get place made live where after back little only round man year
came show every good me give our under name very through just form sentence great think say help low line
differ turn cause much mean before move right boy old too same tell does set three want air well also play
small end put home read hand port large spell add even land here must big high such follow act why ask men
change went light kind off need house picture try us again animal point mother world near build self earth
father head stand own page should country found answer school grow study still learn plant cover food sun
four between state keep eye never last let thought city tree cross farm hard start might story saw far sea
draw left late run while press close night real life few north open seem together next white children begin
got walk example ease paper group always music those both mark often letter until mile river car feet care
second book carry took science eat room friend began idea fish mountain stop once base hear horse cut sure
watch color face wood main enough plain girl usual young ready above ever red list though feel talk bird soon
body dog family direct pose leave song measure door product black short numeral class wind question happen
complete ship area half rock order fire south problem piece told knew pass since top whole king space heard
best hour better true during hundred five remember step early hold west ground interest reach fast verb sing
listen six table travel less morning ten simple several vowel toward war lay against pattern slow center love
person money serve appear road map rain rule govern pull cold notice voice unit power town fine certain fly
fall lead cry dark machine note wait plan figure star box noun field rest correct able pound done beauty drive
stood contain front teach week final gave green quick develop ocean warm free minute strong special mind
behind clear tail produce fact street inch multiply nothing course stay wheel full force blue object decide
surface deep moon island foot system busy test record boat common gold possible plane stead dry wonder laugh
thousand ago ran check game shape equate hot miss brought heat snow tire bring yes distant fill east paint
language among answer sum plus minus times divide equals zero seven eight nine eleven twelve reverse copy
user assistant system tool model function observation hello thanks please sorry yes maybe
""".split()

_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Please write a short story about a little boy and his dog.",
    "I think the answer is correct, but let me check it again.",
    "You are a helpful assistant. Answer the question as well as you can.",
    "Can you help me learn how to multiply two numbers?",
    "Reverse the word: water -> retaw",
    "Copy the text: green tree -> green tree",
    "Thanks! That was very helpful.",
    "Sorry, I do not know the answer to that question.",
    'The tool returned {"result": 42, "unit": "meters"}.',
    'Call the function get_weather with {"city": "Paris"}.',
]


def default_corpus() -> Iterator[str]:
    """The built-in training text, one line per item, always in the same order."""
    yield " ".join(str(d) for d in range(10))
    yield "+ - * / = ( ) < > . , : ; ? ! ' \" [ ] { } _ # % & @ ^ ~ | \\ $"
    for i, word in enumerate(_WORDS):
        # Each word alone, capitalised and mid-sentence, so " word", "word" and "Word" all merge.
        yield f"{word} {word.capitalize()} the {word} of {_WORDS[(i * 7) % len(_WORDS)]}."
    for _ in range(3):
        yield from _SENTENCES
    for a in range(21):
        for b in range(21):
            yield f"{a} + {b} = {a + b}"
            yield f"{a} * {b} = {a * b}"
            if a >= b:
                yield f"{a} - {b} = {a - b}"
    for a in range(0, 1000, 37):
        yield f"What is {a} + {a * 3 % 997}? The answer is {a + a * 3 % 997}."
    for i, word in enumerate(_WORDS[:200]):
        yield f"user\nReverse the word {word}.\nassistant\n{word[::-1]}"
        yield f"system\nYou are a helpful assistant.\nuser\nHow many letters are in {word}?\nassistant\n{len(word)}"
