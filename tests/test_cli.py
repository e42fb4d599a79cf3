"""`python -m qwen_jax` on the captures: logits, generate (on the engine), eval ppl / kv, bench; checked against
the HF transformers references where one exists."""

import json
import re

import numpy as np
import pytest

from pallas_kernels import qmm

from qwen_jax.__main__ import main
from tests.conftest import CAPTURES

TINY = str(CAPTURES / "tiny")
NO_CACHE = ["--compile-cache", ""]
# The generate tests' context: one engine layout, so the decode programs the first of them compiles are the rest's
# (the run's compilation cache; tests/conftest.py). Each reply fits: at most a 102-token prompt and 80 tokens.
SHARED = ["--max-model-len", "256"] + NO_CACHE
REFS = np.load(CAPTURES / "refs" / "hf-tiny-f32.npz")
PROMPTS = json.loads((CAPTURES / "refs" / "prompts.json").read_text())


def _ids(name):
    return REFS[f"{name}.prompt_ids"].tolist()


def _hf_nll(name: str) -> float:
    """HF transformers' mean NLL of a captured text's next tokens, from its float32 logits."""
    ids = _ids(name)
    logits = REFS[f"{name}.logits"].astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return float(-np.mean(logp[np.arange(len(ids) - 1), ids[1:]]))


def test_logits_writes_float32_t_by_vocab(tmp_path):
    out = tmp_path / "logits.npy"
    ids = _ids("short")
    assert main(["logits", "--model", TINY, "--dtype", "float32", "--token-ids", ",".join(map(str, ids)),
                 "--out", str(out)]) == 0
    logits = np.load(out)
    assert logits.dtype == np.float32 and logits.shape == (len(ids), 512)
    assert np.abs(logits - REFS["short.logits"]).max() <= 1e-4


def test_generate_json_on_the_engine(capsys):
    """Greedy under --repetition-penalty 1.3: transformers' continuation under its RepetitionPenaltyLogitsProcessor
    (captures/refs/hf-tiny-penalties-f32.npz; without the penalty the engine's greedy replies are test_engine's)."""
    ids = _ids("repeat")
    want = np.load(CAPTURES / "refs" / "hf-tiny-penalties-f32.npz")["repeat.rep1.3.gen_ids"].tolist()
    assert main(["generate", "--model", TINY, "--dtype", "float32", "--token-ids", ",".join(map(str, ids)),
                 "--max-tokens", str(len(want)), "--ignore-eos", "--json", "--repetition-penalty", "1.3"]
                + SHARED) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_token_ids"] == ids
    assert out["token_ids"] == want
    from qwen_jax.checkpoint import load_tokenizer
    assert out["text"] == load_tokenizer(TINY).decode(want, skip_special_tokens=False)


def test_generate_json_schema(tmp_path, capsys):
    """--json-schema (a file): the reply is a document of the schema (token ids: no template, so the grammar starts
    at once; 80 tokens cover the most whitespace JSON may hold between its five tokens here); a schema the compiler
    refuses is a clear error naming the keyword."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}))
    assert main(["generate", "--model", TINY, "--dtype", "float32", "--token-ids", "5,6,7", "--max-tokens", "80",
                 "--json", "--json-schema", str(schema)] + SHARED) == 0
    text = json.loads(capsys.readouterr().out.splitlines()[-1])["text"]
    assert "".join(text.split()) in ('{"a":1}', '{"a":2}'), text
    with pytest.raises(SystemExit, match="'multipleOf' is not supported"):
        main(["generate", "--model", TINY, "--token-ids", "5", "--max-tokens", "3", "--json-schema",
              '{"type": "integer", "multipleOf": 2}'] + NO_CACHE)


def test_generate_regex(capsys):
    """--regex: the whole reply matches the pattern and stops where nothing may follow; syntax outside the
    supported set is a clear error naming it."""
    pattern = r"(red|green|blue)-[0-9]{2}"
    assert main(["generate", "--model", TINY, "--dtype", "float32", "--token-ids", "5,6,7", "--max-tokens", "20",
                 "--json", "--regex", pattern] + SHARED) == 0
    text = json.loads(capsys.readouterr().out.splitlines()[-1])["text"]
    assert re.fullmatch(pattern, text), text
    with pytest.raises(SystemExit, match="lookaround"):
        main(["generate", "--model", TINY, "--token-ids", "5", "--max-tokens", "3", "--regex", "(?=a)b"] + NO_CACHE)


def test_generate_grammar(tmp_path, capsys):
    """--grammar (a file): the reply is a text of the root rule; a grammar error names what and where."""
    gbnf = tmp_path / "g.gbnf"
    gbnf.write_text('root ::= pair ("," pair){0,2}\npair ::= [a-c] "=" [0-9]\n')
    assert main(["generate", "--model", TINY, "--dtype", "float32", "--token-ids", "5,6,7", "--max-tokens", "20",
                 "--json", "--grammar", str(gbnf)] + SHARED) == 0
    text = json.loads(capsys.readouterr().out.splitlines()[-1])["text"]
    text = re.sub(r"<\|(im_end|endoftext)\|>$", "", text)  # a stop id where the text may end (printed raw)
    assert re.fullmatch(r"[a-c]=[0-9](,[a-c]=[0-9]){0,2}", text), text
    with pytest.raises(SystemExit, match="left recursion"):
        main(["generate", "--model", TINY, "--token-ids", "5", "--max-tokens", "3", "--grammar",
              'root ::= root "a" | "b"'] + NO_CACHE)
    with pytest.raises(SystemExit, match="give one of --regex, --grammar"):
        main(["generate", "--model", TINY, "--token-ids", "5", "--max-tokens", "3", "--regex", "a",
              "--grammar", 'root ::= "a"'] + NO_CACHE)


def test_generate_prompt_too_long_is_a_clear_error():
    with pytest.raises(SystemExit, match="maximum context length is 64"):
        main(["generate", "--model", TINY, "--token-ids", ",".join(["5"] * 64), "--max-tokens", "3",
              "--max-model-len", "64"] + NO_CACHE)


def test_eval_ppl_matches_hf_logits(tmp_path, capsys):
    text = PROMPTS["long"]["text"]
    path = tmp_path / "long.txt"
    path.write_text(text, encoding="utf-8")
    assert main(["eval", "ppl", "--model", TINY, "--dtype", "float32", "--text", str(path), "--chunk", "128",
                 "--json", "--max-model-len", "512"] + NO_CACHE) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["tokens"] == len(_ids("long")) - 1  # the text's tokens (captures/refs/prompts.json)
    assert abs(res["nll"] - _hf_nll("long")) <= 1e-4  # HF logits agree to 1e-4 (tests/test_peer_captures.py)


def test_eval_kv_reports_agreement(capsys):
    assert main(["eval", "kv", "--model", TINY, "--json", "--max-model-len", "256", "--chunk", "128"]
                + NO_CACHE) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["tokens"] > 200
    # e4m3 keeps ~2 significant digits per key/value row: the next-token distributions barely move
    assert res["top1_agreement"] >= 0.9 and 0 <= res["mean_kl"] <= 1e-2 and res["max_kl"] >= res["mean_kl"]


def test_eval_kv_through_decode_windows_matches_hf_logits(tmp_path, capsys):
    """--path decode: the text as chain verify windows of 3 rows (--window-rows; the last one shorter, one across
    the page at 64), each committed before the next. Through the float32 cache the mean NLL is HF transformers'
    (every row sees its whole prefix at its position), and the fp8 cache read by the decode attention moves the
    distributions as little as in prompts. (The default window, 16 rows, took ~4x as long to compile on this CPU;
    the flag's bounds are checked below.)"""
    path = tmp_path / "long.txt"
    path.write_text(PROMPTS["long"]["text"], encoding="utf-8")
    ids = _ids("long")
    rows = 3
    assert (len(ids) - 1) % rows and 64 % rows
    assert main(["eval", "kv", "--model", TINY, "--dtype", "float32", "--text", str(path), "--path", "decode",
                 "--window-rows", str(rows), "--json", "--max-model-len", "512"] + NO_CACHE) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["path"] == "decode" and res["tokens"] == len(ids) - 1
    assert abs(np.log(res["ppl_bf16"]) - _hf_nll("long")) <= 1e-4
    assert res["top1_agreement"] >= 0.9 and 0 <= res["mean_kl"] <= 1e-2
    with pytest.raises(SystemExit, match="--window-rows must be in 1..16"):
        main(["eval", "kv", "--model", TINY, "--path", "decode", "--window-rows", "17"] + NO_CACHE)
    with pytest.raises(SystemExit, match="--path decode is for eval kv"):
        main(["eval", "ppl", "--model", TINY, "--text", str(path), "--path", "decode"] + NO_CACHE)


def test_bench_runs_small(capsys):
    assert main(["bench", "--model", TINY, "--streams", "2", "--prompt-lengths", "100", "--rounds", "2",
                 "--context", "64", "--max-chunk", "128", "--no-compile-timing", "--json"] + NO_CACHE) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["prompt_tokens_per_s"]["100"] > 0 and res["decode_forwards_per_s"]["2"] > 0
    assert res["decode_tokens_per_s"]["2"] == pytest.approx(2 * res["decode_forwards_per_s"]["2"])
    reps = res["decode_repeats"]["2"]  # --repeats 3 by default: the reported figure is their median
    assert len(reps) == 3 and res["decode_forwards_per_s"]["2"] == sorted(reps)[1]
    assert res["qmm_prompt_impl"] == qmm.PROMPT_IMPL


def test_bench_draft_windows(capsys):
    """--draft-rows times chain windows at each stream count beside the decode round; bad values are refused."""
    assert main(["bench", "--model", TINY, "--streams", "1", "--prompt-lengths", "", "--rounds", "2",
                 "--repeats", "1", "--context", "64", "--draft-rows", "3", "--no-compile-timing", "--json"]
                + NO_CACHE) == 0
    res = json.loads(capsys.readouterr().out)
    assert list(res["draft_window_ms"]) == ["1"] and list(res["draft_window_ms"]["1"]) == ["3"]
    assert res["draft_window_ms"]["1"]["3"] > 0 and res["decode_forwards_per_s"]["1"] > 0
    assert res["draft_pipelined_ms"]["1"]["3"] > 0  # the same windows enqueued back to back
    for bad, msg in (("17", "at most 16"), ("0", "positive"), ("2,x", "comma-separated")):
        with pytest.raises(SystemExit, match=msg):
            main(["bench", "--model", TINY, "--streams", "1", "--prompt-lengths", "", "--draft-rows", bad]
                 + NO_CACHE)
    with pytest.raises(SystemExit, match="--draft-rows needs --streams"):
        main(["bench", "--model", TINY, "--streams", "", "--prompt-lengths", "64", "--draft-rows", "2"] + NO_CACHE)
    with pytest.raises(SystemExit, match="--drafter-bits quantizes a drafter"):
        main(["bench", "--model", TINY, "--streams", "1", "--draft-rows", "2", "--drafter-bits", "4"] + NO_CACHE)


@pytest.mark.parametrize("flag,attr,choices", [("--qmm-prompt-impl", "PROMPT_IMPL", ("fused", "dequant")),
                                                 ("--qmm-decode-impl", "DECODE_IMPL", ("triton", "mgpu"))])
def test_bench_qmm_impl_flags_are_scoped(capsys, flag, attr, choices):
    """--qmm-prompt-impl / --qmm-decode-impl reach the run (recorded in the result) and the shipped choice is back
    afterwards."""
    shipped = getattr(qmm, attr)
    other = choices[1] if shipped == choices[0] else choices[0]
    assert main(["bench", "--model", TINY, "--streams", "", "--prompt-lengths", "64", "--max-chunk", "64",
                 "--no-compile-timing", "--json", flag, other] + NO_CACHE) == 0
    assert json.loads(capsys.readouterr().out)[f"qmm_{attr.split('_')[0].lower()}_impl"] == other
    assert getattr(qmm, attr) == shipped


def test_bench_mgpu_knobs_are_scoped(capsys):
    """--mgpu-stages / --mgpu-wide-rows reach the run (recorded in the result), the shipped values are back
    afterwards, and values the kernel does not take are refused by the parser."""
    from pallas_kernels import qmm_mgpu
    shipped = qmm_mgpu.STAGES, qmm_mgpu.WIDE_ROWS
    assert main(["bench", "--model", TINY, "--streams", "", "--prompt-lengths", "64", "--max-chunk", "64",
                 "--no-compile-timing", "--json", "--mgpu-stages", "6", "--mgpu-wide-rows", "32"] + NO_CACHE) == 0
    res = json.loads(capsys.readouterr().out)
    assert (res["mgpu_stages"], res["mgpu_wide_rows"]) == (6, 32)
    assert (qmm_mgpu.STAGES, qmm_mgpu.WIDE_ROWS) == shipped
    for flag, bad in (("--mgpu-stages", "9"), ("--mgpu-wide-rows", "48")):
        with pytest.raises(SystemExit):
            main(["bench", "--model", TINY, flag, bad])
        assert flag in capsys.readouterr().err


def test_fp8_window_flag_is_scoped(capsys):
    """--fp8-window reaches the run (recorded beside an fp8 cache) and the shipped choice is back afterwards."""
    from pallas_kernels import attention_window_mgpu as awm
    shipped = awm.FP8
    other = "triton" if shipped else "mgpu"
    assert main(["bench", "--model", TINY, "--streams", "", "--prompt-lengths", "64", "--max-chunk", "64",
                 "--kv-cache", "fp8", "--no-compile-timing", "--json", "--fp8-window", other] + NO_CACHE) == 0
    assert json.loads(capsys.readouterr().out)["fp8_window"] == other
    assert awm.FP8 == shipped


def test_eval_drafts_flags_are_checked(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("some text to cut prompts from", encoding="utf-8")
    demo = str(CAPTURES.parent / "models" / "demo-mlx-8bit")
    cases = [([], "needs --text"), (["--text", str(text)], "one of --drafter DIR"),
             (["--text", str(text), "--copy-drafts", "--drafter", str(CAPTURES / "tiny-dflash")], "one of --drafter"),
             # this CPU's default backend has no kernels, so no drafted row would have a serial step's bits
             (["--text", str(text), "--copy-drafts"], "run without drafts")]
    for flags, match in cases:
        with pytest.raises(SystemExit, match=match):
            main(["eval", "drafts", "--model", demo, "--max-model-len", "256"] + NO_CACHE + flags)
