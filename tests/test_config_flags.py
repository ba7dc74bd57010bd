"""Engine flags are written once, on EngineConfig's fields: the parser's defaults are the fields'."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from meshserve.config import EngineConfig
from meshserve.utils.checks import check_range


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    return p


def test_no_flags_give_the_dataclass_defaults():
    assert EngineConfig.from_cli_args(_parser().parse_args([])) == EngineConfig()


def test_every_flagged_field_is_a_flag_with_the_fields_default():
    actions = {a.dest: a for a in _parser()._actions}
    flagged = [f for f in dataclasses.fields(EngineConfig) if "flag" in f.metadata]
    assert len(flagged) > 20
    for f in flagged:
        assert actions[f.name].default == f.default, f.name


def test_flags_parse_into_their_fields():
    args = _parser().parse_args(["m.gguf", "--max-num-seqs", "7", "--no-enable-prefix-caching", "-tp", "2",
                                 "--kv-cache-memory", "2GiB", "--pipeline-split", "3,5", "-pp", "2",
                                 "--enforce-eager"])
    cfg = EngineConfig.from_cli_args(args)
    assert (cfg.model, cfg.max_num_seqs, cfg.enable_prefix_caching, cfg.tensor_parallel_size) == ("m.gguf", 7, False, 2)
    assert (cfg.kv_cache_memory_bytes, cfg.pipeline_split, cfg.enforce_eager) == (2 << 30, [3, 5], True)


@pytest.mark.parametrize("args,message", [
    (("n", 0, 1, 128), "n must be in [1, 128], got 0"),
    (("--port", 70000, 0, 65535), "--port must be in [0, 65535], got 70000"),
    (("top_p", 0.0, 0.0, 1.0), "top_p must be in (0, 1], got 0.0"),
    (("--lease-ttl", 0, 0.1, None), "--lease-ttl must be >= 0.1, got 0"),
    (("x", True, 0, 1), "x must be a number, got True"),
    (("x", float("nan"), 0, 1), "x must be in [0, 1], got nan"),
])
def test_one_range_check_names_the_value_and_the_range(args, message):
    name, value, lo, hi = args
    with pytest.raises(ValueError) as err:
        check_range(name, value, lo, hi, lo_open=name == "top_p")
    assert str(err.value) == message
