"""The Ray backend runs TP=2 as Ray actors on a local Ray cluster and yields the mp backend's tokens."""
import json
import os
import subprocess
import sys
from pathlib import Path

from parallel_helpers import generate_ids

HERE = Path(__file__).resolve().parent

# Runs in its own process: Ray starts a local cluster (2 CPUs, no dashboard) and tears it down after.
_RAY_SCRIPT = """
import json, sys
import ray
ray.init(num_cpus=2, include_dashboard=False)
from meshserve import LLM
from parallel_helpers import ENGINE_ARGS, GREEDY, prompts
llm = LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE_ARGS)
ids = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY)]
llm.engine.executor.check_health()
print("RESULT " + json.dumps({"executor": type(llm.engine.executor).__name__, "ids": ids}))
llm.engine.shutdown()
ray.shutdown()
"""


def test_ray_backend_matches_mp(tiny_kv2):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           # Keeps the local Ray cluster on the loopback address instead of the host's network address.
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    proc = subprocess.run([sys.executable, "-c", _RAY_SCRIPT, tiny_kv2], env=env, capture_output=True,
                          text=True, timeout=240)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[0].removeprefix("RESULT "))
    assert result["executor"] == "RayExecutor"
    assert result["ids"] == generate_ids(tiny_kv2, tensor_parallel_size=2, distributed_executor_backend="mp")
