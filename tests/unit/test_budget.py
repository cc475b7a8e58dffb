"""The memory budget (tracekit.core.budget): parsing, the chunk rule, the refusal, OOM halving."""

from __future__ import annotations

import pytest
import torch

import tracekit as tk
from tracekit.config import parse_config
from tracekit.core.budget import chunk_rows, current_budget, parse_budget, run_chunked
from tracekit.errors import ConfigError, MemoryBudgetError


@pytest.mark.parametrize("value,expect", [("4GiB", (4 * 1024**3, None)), ("512MB", (512 * 1000**2, None)),
                                          (2e9, (2_000_000_000, None)), ("40%", (None, 0.4)),
                                          ("auto", (None, 0.3)), (None, (None, 0.3))])
def test_parse(value, expect):
    assert parse_budget(value) == expect


@pytest.mark.parametrize("value", ["lots", "0%", "150%", -5, 0, True, "4 parsecs"])
def test_bad_budget_names_the_field(value):
    with pytest.raises(MemoryBudgetError, match="run.memory_budget"):
        parse_budget(value)


def test_config_block():
    cfg = parse_config({"run": {"memory_budget": "2GiB"}, "experiments": [{"kind": "logit_lens", "prompts": ["a"]}]})
    assert cfg.run.memory_budget == "2GiB"
    with pytest.raises(ConfigError, match=r"run\.memory_budget: 'lots' is not a memory budget"):
        parse_config({"run": {"memory_budget": "lots"}, "experiments": [{"kind": "logit_lens", "prompts": ["a"]}]})


def test_chunk_rule_and_refusal():
    with tk.memory_budget("1MiB"):
        assert current_budget().bytes == 1024**2
        assert chunk_rows(1000, 5000, what="x") == 1024**2 // 1000
        assert chunk_rows(1000, 7, what="x") == 7
        assert chunk_rows(1000, 5000, what="x", fixed=1024**2 - 3000) == 3
        with pytest.raises(MemoryBudgetError, match=r"lens: one row needs about 2\.0 MiB .* allows 1\.0 MiB.*"
                                                    r"at least '3MiB', or shorten the prompt"):
            chunk_rows(2 * 1024**2, 5, what="lens", fix="shorten the prompt")
    assert current_budget(value="3MiB").bytes == 3 * 1024**2  # the block has ended


def test_run_chunked_halves_on_oom(caplog):
    seen: list[tuple[int, int]] = []
    out = torch.zeros(10)

    def fn(sl: slice) -> None:
        if sl.stop - sl.start > 2:
            raise RuntimeError("CUDA out of memory. Tried to allocate")
        seen.append((sl.start, sl.stop))
        out[sl] += 1

    with caplog.at_level("WARNING"):
        assert run_chunked(fn, 10, 8, what="test engine") == 2
    assert torch.equal(out, torch.ones(10)) and seen[0] == (0, 2)
    assert "test engine: out of memory, halving the chunk to 4" in caplog.text

    def other(sl: slice) -> None:
        raise ValueError("not memory")

    with pytest.raises(ValueError):
        run_chunked(other, 3, 2)
