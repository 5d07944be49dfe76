"""The runtime's lifecycle in a replay (replayer/api.py, replayer/core.py replay_loaded): made,
its prefill_chunk set, prepare(input_ids, extra_inputs) called once with REF's prompt before the
first step, the steps, close(); a plug-in's failure in prepare is one line naming where."""

from __future__ import annotations

import pytest

from gemma4_trace.recorder.golden import golden_path
from gemma4_trace.replayer.replay import ReplayOptions, replay_trace
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.reader import TraceReader

CALLS: list = []


class Recorded:
    """The static runtime, every contract call noted in CALLS."""

    supports_prefill_chunk = True

    def __init__(self, loaded, max_seq: int, fail: bool = False):
        from gemma4_trace.replayer.runtime import create

        self.rt, self.fail, self.name = create(loaded, max_seq), fail, "recorded"

    @property
    def prefill_chunk(self):
        return self.rt.prefill_chunk

    @prefill_chunk.setter
    def prefill_chunk(self, rows):
        CALLS.append(("prefill_chunk", rows))
        self.rt.prefill_chunk = rows

    def prepare(self, input_ids, extra_inputs):
        CALLS.append(("prepare", [int(t) for t in input_ids]))
        if self.fail:
            raise OSError("the files are not there")

    def prefill(self, input_ids, extra_inputs, probe):
        CALLS.append(("prefill",))
        return self.rt.prefill(input_ids, extra_inputs, probe)

    def decode(self, token_id, position, probe):
        CALLS.append(("decode",))
        return self.rt.decode(token_id, position, probe)

    def close(self):
        CALLS.append(("close",))


def make(loaded, max_seq):
    return Recorded(loaded, max_seq)


def make_failing(loaded, max_seq):
    return Recorded(loaded, max_seq, fail=True)


def test_prepare_is_called_once_with_refs_prompt_after_prefill_chunk_and_before_the_steps(tmp_path):
    CALLS.clear()
    ref = golden_path("short")
    replay_trace(ref, tmp_path / "run.h5", ReplayOptions(runtime=f"{__name__}:make", prefill_chunk=4))
    with TraceReader(ref) as r:
        prompt, steps = [int(t) for t in r.prompt_ids], r.n_steps
    assert CALLS[:3] == [("prefill_chunk", 4), ("prepare", prompt), ("prefill",)]
    assert CALLS[3:] == [("decode",)] * (steps - 1) + [("close",)]


def test_a_plugins_failure_in_prepare_is_one_line_naming_its_code(tmp_path):
    CALLS.clear()
    out = tmp_path / "run.h5"
    with pytest.raises(TraceToolError) as e:
        replay_trace(golden_path("short"), out, runtime=f"{__name__}:make_failing")
    line = str(e.value)
    assert line.startswith("runtime recorded failed in preparing at ") and "test_lifecycle.py:" in line, line
    assert "OSError: the files are not there" in line and "\n" not in line
    assert not out.exists() and CALLS[-1] == ("close",)


def test_options_and_keywords_are_one_thing():
    assert ReplayOptions.of(runtime="llama.cpp", gguf="m.gguf").files == {"gguf": "m.gguf"}
    with pytest.raises(TypeError):
        replay_trace("REF.h5", "RUN.h5", ReplayOptions(), runtime="static")
