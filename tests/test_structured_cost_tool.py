"""tools/gpu/structured_cost.py end to end at its tiniest setting on the CPU (one free stream, a few tokens): the
synthetic tokenizer gives the engine its TokenBytes, every phase yields rates, the structured stream's masks are
computed when its grammar is new and come from the cache when the same requests run again, those requests reply the
same both times (beside the same free stream), and the plain control stream runs without a grammar."""

import importlib.util
import sys

from tests.conftest import ROOT


def _tool():
    spec = importlib.util.spec_from_file_location("structured_cost", ROOT / "tools" / "gpu" / "structured_cost.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_structured_cost_tool_runs_on_the_cpu(capsys):
    tool = _tool()
    rows = tool.main(["--synthetic", "tiny", "--layers", "2", "--streams", "1", "--rounds", "8", "--warmup", "2",
                      "--context", "64", "--structured-prompt", "16", "--repeats", "1"])
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("| 1 | ") and out[-3].startswith("| free streams |"), out[-4:]
    assert "python tools/gpu/structured_cost.py --synthetic tiny" in "\n".join(out)
    [row] = rows
    alone, new, again, plain = row.alone_runs[0], row.new_runs[0], row.again_runs[0], row.plain_runs[0]
    assert min(p.forwards_per_s for p in (alone, new, again, plain)) > 0
    assert not alone.documents and plain.extra_tokens > 0 and not (plain.computed_s or plain.cached_s)
    assert new.extra_tokens > 0 and new.documents and new.computed_s
    assert again.cached_s and len(again.computed_s) < len(new.computed_s)
    first, repeated = new.documents[0][2], again.documents[0][2]
    shorter = min(first, repeated, key=len)
    assert shorter and max(first, repeated, key=len).startswith(shorter)
