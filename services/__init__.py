"""The Sparrow services: generator, trainer and controller processes (they use the core, never the reverse).

The rewards the services ship are registered here by import path, so that every process that imports
a service (the trainer, its reward workers, the launcher's checks) knows their names while the core
names no service; the module behind a name is imported only when the reward is used.
"""

from sparrow.reward_registry import register_reward

# Runs the response's code in the sandbox service (services/sandbox/); 180 s covers a request at the
# sandbox's max_request_s (120 s) and a minute of waiting through a restarting or busy sandbox.
register_reward("code", "services.sandbox.reward:code_score", timeout_s=180.0)
