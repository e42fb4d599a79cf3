"""Train the tiny byte-level BPE tokenizer used by every capture checkpoint.

The layout mirrors Qwen2/Qwen3's tokenizer.json (NFC normaliser, the Qwen regex split, byte-level BPE, specials
appended after the BPE vocabulary) at toy scale: 256 byte tokens + 235 merges + 9 added tokens = 500 ids, so the
model's vocab_size of 512 leaves 12 padded embedding rows that no text maps to, as in the real checkpoints
(248320 rows vs ~248077 tokenizer ids).

Usage: python make_tokenizer.py OUT_DIR
"""

import hashlib
import json
import sys
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Debian base-files 12.4 ships these texts on every machine of this kind; the hashes pin the training corpus so a
# changed file fails loudly instead of silently producing a different vocabulary.
CORPUS = {
    "/usr/share/common-licenses/Apache-2.0": "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30",
    "/usr/share/common-licenses/GPL-3": "3972dc9744f6499f0f9b2dbf76696f2ae7ad8af9b23dde66d6af86c9dfb36986",
    "/usr/share/common-licenses/BSD": "5d588eb3b157d52112afea935c88a7ff9efddc1e2d95a42c25d3b96ad9055008",
}

NUM_MERGES = 235
BYTE_ALPHABET = 256

# Same split pattern as Qwen3.5's tokenizer (transformers models/qwen3_5/tokenization_qwen3_5.py): letters include
# combining marks (\p{M}), unlike Qwen2/Qwen3.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# (content, special): order fixes the ids (491..499). <think>/</think> are ordinary added tokens in Qwen, so
# skip_special_tokens keeps them when decoding.
ADDED_TOKENS = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<think>", False),
    ("</think>", False),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
]

CHAT_TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")


def read_corpus() -> list[str]:
    texts = []
    for path, want in CORPUS.items():
        data = Path(path).read_bytes()
        got = hashlib.sha256(data).hexdigest()
        if got != want:
            raise SystemExit(f"{path}: sha256 {got} != pinned {want}; the tokenizer would not be reproducible")
        texts.append(data.decode("utf-8"))
    return texts


def train() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BYTE_ALPHABET + NUM_MERGES,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(read_corpus(), trainer=trainer)
    if tok.get_vocab_size() != BYTE_ALPHABET + NUM_MERGES:
        raise SystemExit(f"trained vocab is {tok.get_vocab_size()}, expected {BYTE_ALPHABET + NUM_MERGES}")
    return tok


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    core = train()
    # Added to the core tokenizer so tokenizer.json carries each token's own `special` flag, as Qwen's does.
    core.add_tokens(
        [AddedToken(c, special=s, normalized=False, lstrip=False, rstrip=False, single_word=False)
         for c, s in ADDED_TOKENS]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=[c for c, s in ADDED_TOKENS if s and c not in ("<|im_end|>", "<|endoftext|>")],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
        padding_side="right",
        split_special_tokens=False,
    )
    fast.chat_template = CHAT_TEMPLATE_PATH.read_text()
    ids = {c: fast.convert_tokens_to_ids(c) for c, _ in ADDED_TOKENS}
    expected = {c: BYTE_ALPHABET + NUM_MERGES + i for i, (c, _) in enumerate(ADDED_TOKENS)}
    if ids != expected:
        raise SystemExit(f"added-token ids {ids} != expected {expected}")
    fast.save_pretrained(str(out))
    print(json.dumps({"dir": str(out), "len": len(fast), "added": ids}))


if __name__ == "__main__":
    main(sys.argv[1])
