"""One process of a multi-process test: initialize JAX's distributed runtime, run a scenario."""

import importlib
import json
import os
import sys

import jax

port, num_processes, process_id, scenario, *args = sys.argv[1:]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_enable_x64", True)
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=int(num_processes), process_id=int(process_id))

module, _, function = scenario.rpartition(".")  # "tiers.tier_scenarios.f": another module's scenario
# after initialize, like a training script
scenarios = importlib.import_module(f"tests.{module or 'support.mp_scenarios'}")
result = getattr(scenarios, function)(*args)
print("RESULT " + json.dumps(result), flush=True)
if result.get("peer_killed"):
    os._exit(0)  # shutdown() would wait for the dead peer
jax.distributed.shutdown()
