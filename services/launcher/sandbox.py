"""The code sandbox of a run: whether `sparrow up` starts one, its config and jail check, how the trainer finds it.

A run starts the sandbox (`sparrow sandbox`, services/sandbox/) as a child when one of its rewards is
`code` (by `[trainer.reward]` or a dataset's data_source), or when `with_sandbox = "always"`; with
`sandbox_url` set it uses that one instead. The trainer's reward workers reach it through
CODE_SANDBOX_URL and CODE_SANDBOX_TOKEN (a random token per run), as in the Helm chart. That the jail
works is checked before anything starts: bubblewrap missing or without user namespaces is one line,
unless `[sandbox.jail] insecure_local = true` was set, which is warned about at every start.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from services.launcher.config import UpConfig
from services.launcher.ports import HOST, PortError, Ports, with_sandbox_port
from services.launcher.services import ChildConfigs, resolve_sandbox
from services.sandbox.config import SandboxConfig
from sparrow.config import ConfigError

CODE_REWARD = "code"
URL_ENV, TOKEN_ENV = "CODE_SANDBOX_URL", "CODE_SANDBOX_TOKEN"  # what services/sandbox/reward.py reads


class SandboxSetupError(ValueError):
    """The sandbox cannot run here (the launcher's SetupError wraps it); one line."""


@dataclass(frozen=True)
class SandboxPlan:
    """The run's children and ports with the sandbox decided, and what to warn about."""

    children: ChildConfigs
    ports: Ports
    url: str  # where the trainer's code reward goes; "" when the run has no sandbox
    warnings: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for the dry run."""
        if self.children.sandbox is not None:
            jail = "UNJAILED (insecure_local)" if self.children.sandbox.jail.insecure_local else "bubblewrap works"
            return f"started by sparrow up at {self.url} ({jail}; {self.children.sandbox.pool.workers} workers)"
        return f"the service at {self.url}" if self.url else "none (no reward of the run needs it)"


def configured_rewards(children: ChildConfigs) -> set[str]:
    """Reward names the trainer's config names (the datasets' data_source columns may add more)."""
    r = children.trainer.reward
    return {name for name in (r.name, *r.by_source.values()) if name}


def wants_sandbox(up: UpConfig, rewards: set[str]) -> bool:
    """Whether the run starts a sandbox of its own."""
    if up.sandbox_url or up.with_sandbox == "never":
        return False
    return up.with_sandbox == "always" or CODE_REWARD in rewards


def check_jail(config: SandboxConfig) -> tuple[str, ...]:
    """The jail runs a program here (as the sandbox checks at its start): the warnings to show, or
    SandboxSetupError (one line) where bubblewrap is missing or cannot run."""
    from services.sandbox.main import INSECURE_WARNING, SetupError, build_jail

    try:
        build_jail(config)
    except SetupError as exc:
        raise SandboxSetupError(
            f"{exc}; or give sandbox_url, or (development only) set sandbox.jail.insecure_local = true"
        ) from None
    return (f"sandbox: {INSECURE_WARNING}",) if config.jail.insecure_local else ()


def plan_sandbox(up: UpConfig, children: ChildConfigs, ports: Ports, rewards: set[str]) -> SandboxPlan:
    """Decide the run's sandbox from the rewards it uses; ConfigError or SandboxSetupError (one line)."""
    if (up.sandbox_url or wants_sandbox(up, rewards)) and "url" in children.trainer.reward.options.get(CODE_REWARD, {}):
        raise ConfigError("trainer.reward.options.code.url is set by sparrow up; use sandbox_url instead")
    if up.sandbox and not wants_sandbox(up, rewards):
        why = "sandbox_url is set" if up.sandbox_url else "the run starts no sandbox (with_sandbox, its rewards)"
        raise ConfigError(f"[sandbox] configures the started sandbox, but {why}")
    if not wants_sandbox(up, rewards):
        return SandboxPlan(children, ports, up.sandbox_url.rstrip("/"))
    try:
        ports = with_sandbox_port(ports, up.ports.sandbox)
    except PortError as exc:
        raise SandboxSetupError(str(exc)) from None
    config = resolve_sandbox(up, ports.sandbox)
    warnings = check_jail(config)
    return SandboxPlan(replace(children, sandbox=config), ports, f"http://{HOST}:{ports.sandbox}", warnings)


def trainer_environment(url: str, token: str | None) -> dict[str, str]:
    """The variables the trainer's code reward reads: the sandbox's URL and (a started one's) token."""
    if not url:
        return {}
    return {URL_ENV: url, **({TOKEN_ENV: token} if token else {})}


def sandbox_environment(base: dict[str, str], token: str) -> dict[str, str]:
    """The sandbox child's environment: no SPARROW_* variable of the launcher's (the cluster's tokens among
    them; its programs never see its environment, but the service needs none of them), its own token."""
    env = {k: v for k, v in base.items() if not k.startswith("SPARROW_") and k not in (URL_ENV, TOKEN_ENV)}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["SPARROW_SECURITY__TOKEN"] = token
    return env
