"""The fixed capture prompts: texts and chat turns, encoded once with the capture tokenizer into prompts.json.

Usage: python prompts.py TOKENIZER_DIR OUT_JSON
"""

import json
import sys

from transformers import AutoTokenizer

SHORT_TEXT = "You may copy the work freely."

# Written for these captures (not from the tokenizer's training corpus); long enough to cross several 64-row
# GDN chunks.
LONG_TEXT = (
    "The lighthouse keeper kept a careful log of every ship that passed the point. Each morning he wrote the date, "
    "the direction of the wind, the height of the waves and the colour of the sky, and each evening he climbed the "
    "ninety steps to light the lamp. Most days were the same, and he liked them that way. In spring the gulls came "
    "back to nest on the rocks below the tower, and in autumn the storms arrived from the west and shook the glass "
    "in its frame. He kept bread, tea and a small stove in the room at the bottom of the stairs.\n\n"
    "One winter a small boat ran onto the reef in the dark, and he rowed out with a rope and a second lamp."
)

REPEAT_PHRASE = "the copy of the program is free. "
REPEAT_COUNT = 10  # about 10 ids per phrase -> about 100 ids

CHAT_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What does the keeper write?"},
    {"role": "assistant", "content": "The date and the wind."},
    {"role": "user", "content": "And after the storm?"},
]


def build(tokenizer_dir: str) -> dict:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    repeat_text = REPEAT_PHRASE * REPEAT_COUNT
    chat_text = tok.apply_chat_template(
        CHAT_MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    chat_ids = tok.apply_chat_template(
        CHAT_MESSAGES, tokenize=True, add_generation_prompt=True, enable_thinking=False, return_dict=False
    )
    if chat_ids != tok.encode(chat_text):
        raise SystemExit("apply_chat_template(tokenize=True) disagrees with encode(rendered text)")
    prompts = {
        "short": {"text": SHORT_TEXT, "ids": tok.encode(SHORT_TEXT)},
        "long": {"text": LONG_TEXT, "ids": tok.encode(LONG_TEXT)},
        "repeat": {"text": repeat_text, "ids": tok.encode(repeat_text)},
        "chat": {
            "text": chat_text,
            "messages": CHAT_MESSAGES,
            "chat_template_kwargs": {"add_generation_prompt": True, "enable_thinking": False},
            "ids": chat_ids,
        },
    }
    if len(prompts["long"]["ids"]) < 320:
        raise SystemExit(f"long prompt has {len(prompts['long']['ids'])} ids, need >= 320")
    return prompts


def main(tokenizer_dir: str, out_json: str) -> None:
    prompts = build(tokenizer_dir)
    with open(out_json, "w") as f:
        json.dump(prompts, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(json.dumps({name: len(p["ids"]) for name, p in prompts.items()}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
