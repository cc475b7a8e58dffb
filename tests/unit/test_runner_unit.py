"""Runner pieces that need no model: the half-precision note, status reading, unique run dirs."""

from __future__ import annotations

import json
import os
import threading

import pytest

from tracekit.config import parse_config
from tracekit.errors import OutputError
from tracekit.runner import _half_precision_note, check_writable, new_run_dir, read_status


def test_half_precision_on_cpu_is_said_once():
    lines = []
    cfg = parse_config({"model": {"dtype": "bfloat16", "device": "cpu"},
                        "experiments": [{"kind": "logit_lens", "prompts": ["a"]}]})
    _half_precision_note(cfg, lines.append)
    assert len(lines) == 1 and "float32" in lines[0] and "bfloat16" in lines[0]
    lines.clear()
    _half_precision_note(parse_config({"experiments": [{"kind": "logit_lens", "prompts": ["a"]}]}), lines.append)
    assert lines == []


def test_run_dirs_are_unique_under_concurrency(tmp_path):
    made, errors = [], []

    def make():
        try:
            made.append(new_run_dir(tmp_path, "same"))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=make) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(made)) == 16


def test_status_of_a_dead_process_reads_as_interrupted(tmp_path):
    import socket

    (tmp_path / "status.json").write_text(json.dumps({"status": "running", "pid": 2**22 + 12345,
                                                      "host": socket.gethostname(), "step": "s"}))
    st = read_status(tmp_path)
    assert st["status"] == "interrupted" and st["process_gone"]
    (tmp_path / "status.json").write_text(json.dumps({"status": "running", "pid": os.getpid(),
                                                      "host": socket.gethostname()}))
    assert read_status(tmp_path)["status"] == "running"
    assert read_status(tmp_path / "nothing")["status"] == "unknown"


def test_output_folder_under_a_file_is_refused(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(OutputError, match="not a writable folder"):
        check_writable(f / "out")
