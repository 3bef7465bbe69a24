"""The run's prompts, built from `[data]`: sources loaded, templated, filtered, mixed; rewards chosen per source.

With no `data.train_files`, the built-in chain task is generated as verl rows and read through the
same row parser and renderer as a user's file (sparrow.tasks.dataset.py): one data path. Everything
that can be wrong with the input (a missing file, no prompt column, a template refusing a role,
every prompt too long, an unknown or unimportable reward, an eval set without answers) raises
DataInputError here, in one line, so the launcher can check it before any service starts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from services.trainer.config import TrainerServiceConfig
from services.trainer.http_reward import check_http_reward, is_http_reward
from sparrow.data import DataError, SampleSet, load_samples
from sparrow.mix import Mix, Source
from sparrow.prompts import ChatSettings, PreparedSource, Prompt, PromptError, Renderer, prepare_source, stop_token_ids
from sparrow.reward_registry import DEFAULT_REWARD, RewardError, load_reward, reward_names
from sparrow.rows import RowShape, parse_row
from sparrow.tasks import ChainTask
from sparrow.tasks.dataset import DATA_SOURCE as CHAIN_SOURCE
from sparrow.tasks.dataset import chain_rows

log = logging.getLogger("sparrow.trainer.data")


class DataInputError(ValueError):
    """The run's datasets, template or rewards cannot be used; one line."""


@dataclass
class TrainingData:
    """Prompts ready for the feeder, the eval set, and the reward of each data_source."""

    train: list[PreparedSource]
    eval: list[PreparedSource]
    ratios: list[float]
    stop_ids: tuple[int, ...]
    rewards: dict[str, str] = field(default_factory=dict)  # data_source -> reward name
    renderer: str = ""

    def mix(self, seed: int, shuffle: bool = True) -> Mix[Prompt]:
        """The training prompts' endless stream."""
        sources = [Source(s.name, s.prompts, r) for s, r in zip(self.train, self.ratios, strict=True)]
        return Mix(sources, seed, shuffle)

    @property
    def longest_prompt(self) -> int:
        """The longest prompt kept, train or eval, in tokens (sizes the generators' max_model_len)."""
        return max(s.longest for s in [*self.train, *self.eval])


def reward_name(config: TrainerServiceConfig, data_source: str) -> str:
    """The reward of a data_source: by_source, else reward.name, else a registered name equal to it, else math."""
    r = config.reward
    if data_source in r.by_source:
        return r.by_source[data_source]
    if r.name:
        return r.name
    return data_source if data_source in reward_names() else DEFAULT_REWARD


def build_training_data(config: TrainerServiceConfig, tokenizer, model_dir: str | Path | None = None) -> TrainingData:
    """Load, template and check every source and reward; DataInputError (one line) on any problem."""
    d = config.data
    try:
        chat = ChatSettings(d.chat_template, dict(d.chat_template_kwargs), d.system_prompt)
        renderer = Renderer(tokenizer, chat)
        shape = RowShape(d.prompt_key, d.answer_key, d.answer_extraction)
        if d.train_files:
            sets = [load_samples(f, shape, d.on_bad_row) for f in d.train_files]
        else:
            task = config.task
            sets = [_chain_set(task.chain(), task.count, task.seed)]
        evals = [load_samples(f, shape, d.on_bad_row) for f in d.eval_files]
        for e in evals:
            if not any(s.ground_truth is not None for s in e.samples):
                raise DataInputError(f"eval set {e.path}: no row has an answer; evaluation needs answers to score")
        train = [_prepare(s, renderer, config) for s in sets]
        held = [_prepare(s, renderer, config) for s in evals]
    except (DataError, PromptError) as exc:
        raise DataInputError(str(exc)) from None
    sources = sorted({p.sample.data_source for s in [*train, *held] for p in s.prompts})
    rewards = {src: reward_name(config, src) for src in sources}
    signatures = {}
    for name in sorted(set(rewards.values()) | set(config.reward.by_source.values())):
        if is_http_reward(name):  # served: the server must answer now, its shape is its JSON
            problem = check_http_reward(name, config.reward.http.timeout_s)
            if problem is not None:
                raise DataInputError(problem)
            continue
        try:
            signatures[name] = load_reward(name)[1]
        except RewardError as exc:
            raise DataInputError(str(exc)) from None
    _check_columns([*train, *held], rewards, signatures)
    stops = stop_token_ids(tokenizer, model_dir or config.model_dir, tuple(config.sampling.stop_token_ids))
    if not stops:
        raise DataInputError("no stop token: the tokenizer and generation_config.json name no eos; set stop_token_ids")
    data = TrainingData(train, held, list(d.ratios) or [1.0] * len(train), stops, rewards, renderer.mode)
    for line in describe(data):
        log.info("%s", line)
    return data


def _check_columns(sources: list[PreparedSource], rewards: dict[str, str], signatures: dict) -> None:
    """A TRL reward that names a column some of its rows lack would fail every call: refused at start."""
    columns: dict[str, set[str]] = {}
    for s in sources:
        for p in s.prompts:
            have = set(p.sample.columns)
            src = p.sample.data_source
            columns[src] = columns[src] & have if src in columns else have
    for src, have in sorted(columns.items()):
        missing = signatures[rewards[src]].missing_columns(have) if rewards[src] in signatures else []
        if missing:
            raise DataInputError(
                f"reward {rewards[src]!r} takes {', '.join(missing)}, which not every row of source {src} has "
                f"(columns every row has: {', '.join(sorted(have)) or 'none'})"
            )


def describe(data: TrainingData) -> list[str]:
    """One line per source, for the log at start."""
    lines = [f"prompts rendered with {data.renderer}; stop ids {list(data.stop_ids)}"]
    for kind, sources in (("train", data.train), ("eval", data.eval)):
        for s in sources:
            note = f", {s.too_long} over max_prompt_tokens filtered" if s.too_long else ""
            note += f", {len(s.bad)} refused by the template" if s.bad else ""
            lines.append(f"{kind} source {s.name}: {len(s.prompts)} prompts (longest {s.longest} tokens){note}")
    lines.append("rewards: " + ", ".join(f"{src} -> {name}" for src, name in sorted(data.rewards.items())))
    return lines


def _chain_set(task: ChainTask, count: int, seed: int) -> SampleSet:
    rows = chain_rows(task, count, seed, "train")
    samples = [parse_row(r, i, RowShape(), CHAIN_SOURCE, "row", "chain") for i, r in enumerate(rows, start=1)]
    return SampleSet(path=Path(f"chain-{task.name}"), samples=samples)  # generated rows always parse


def _prepare(s: SampleSet, renderer: Renderer, config: TrainerServiceConfig) -> PreparedSource:
    d = config.data
    for bad in s.skipped[:3]:
        log.warning("skipped %s", bad)
    if s.skipped:
        log.warning("%s: %d bad rows skipped", s.path, len(s.skipped))
    return prepare_source(s.path.stem, s.samples, renderer, d.max_prompt_tokens, d.on_long_prompt, d.on_bad_row)
