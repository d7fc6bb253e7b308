"""Checks of a run config against the graph it asks for, before any rank starts."""
from __future__ import annotations

import json
from pathlib import Path

from tidal.executors.generator.engines import ENGINES
from tidal.executors.trainer.backends import BACKENDS
from tidal.recipes.config import RunConfig


def check_trainer(cfg: RunConfig, *, dynamic_sampling: bool) -> None:
    t = cfg.trainer
    if t.mini_batches * t.dp > cfg.data.prompts_per_step:
        raise ValueError(f"trainer.mini_batches ({t.mini_batches}) x trainer.dp ({t.dp}) exceeds "
                         f"data.prompts_per_step ({cfg.data.prompts_per_step}): a mini-batch would be empty")
    if dynamic_sampling and t.fsdp and t.dp > 1:
        raise ValueError("algorithm.dynamic_sampling with trainer.fsdp and trainer.dp > 1 is not supported: FSDP "
                         "ranks train in rounds of one group each, which needs every prompt index of the batch")
    if t.precision != "fp32" and cfg.model.dtype != "float32":
        raise ValueError(f"trainer.precision={t.precision} keeps float32 master weights: it needs model.dtype=float32 "
                         f"(got {cfg.model.dtype}; model.dtype=bfloat16 alone trains pure bf16 weights)")
    if t.precision == "fp16" and not BACKENDS.get(t.backend).fp16:
        raise ValueError(f"trainer.precision=fp16 with trainer.backend={t.backend}: that backend has no loss scale "
                         f"(tidal/modeling/loss_scale.py); use trainer.precision=bf16 there, or "
                         f"{BACKENDS.offer(lambda b: b.fp16)}")
    BACKENDS.get(t.backend).check(t, cfg.model.path)
    if cfg.algo_config is not None and cfg.algo_config.needs_entropy and not BACKENDS.get(t.backend).entropy_bonus:
        what = (f"algorithm.entropy_coef={cfg.algo_config.entropy_coef}" if cfg.algo_config.entropy_coef else
                f"algorithm.penalties={cfg.algo_config.penalties} (a penalty that reads the entropy)")
        raise ValueError(f"{what} with trainer.backend={t.backend}: that backend's entropy has no gradient; "
                         f"{BACKENDS.offer(lambda b: b.entropy_bonus)}")
    if dynamic_sampling and t.mini_batches > 1:
        raise ValueError("algorithm.dynamic_sampling with trainer.mini_batches > 1 is not supported yet "
                         "(kept prompt indices are not contiguous, so a mini-batch could be empty)")


def check_pipeline(cfg: RunConfig, *, batch_scope: bool) -> None:
    """trainer.pp: what its schedule (tidal/modeling/megatron/pipeline.py) runs: one loss pass per micro-batch,
    on the megatron backend (which also refuses LoRA, MoE and fp16)."""
    t = cfg.trainer
    if t.pp == 1:
        return
    field = f"trainer.pp={t.pp}"
    if not BACKENDS.get(t.backend).pipeline:
        raise ValueError(f"{field}: trainer.backend={t.backend} has no pipeline parallel; "
                         f"{BACKENDS.offer(lambda b: b.pipeline)}")
    if batch_scope:
        raise ValueError(f"{field} with algorithm {cfg.algo!r}: batch-scope advantages train each micro-batch in "
                         f"two loss passes, which the pipeline schedule does not carry; use a group-scope algorithm")


def check_context(cfg: RunConfig, *, critic: bool) -> None:
    """trainer.cp (tidal/modeling/parallel/cp.py): a packed row split over ranks, one line for what it does not cover."""
    t = cfg.trainer
    if critic and cfg.critic.cp > 1:
        raise ValueError(f"critic.cp={cfg.critic.cp}: context parallel is built for the trainer's policy only; "
                         f"set critic.cp=1")
    if t.cp == 1:
        return
    field = f"trainer.cp={t.cp}"
    if not BACKENDS.get(t.backend).context_parallel:
        raise ValueError(f"{field} with trainer.backend={t.backend}: that backend has no context parallel; "
                         f"{BACKENDS.offer(lambda b: b.context_parallel)}")
    if t.shared_prompt == "padded":
        raise ValueError(f"{field} with trainer.shared_prompt=padded: context parallel splits a packed row; use "
                         f"trainer.shared_prompt=auto, on or off")
    for name, n in (("trainer.tp", t.tp), ("trainer.ep", t.ep)):
        if n > 1:
            raise ValueError(f"{field} with {name}={n}: context parallel runs with tp=1 and ep=1 for now "
                             f"(dp and FSDP are fine: cp runs inside dp)")
    if cfg.model.numerics == "exact":
        raise ValueError(f"{field} with model.numerics=exact: a query's attention over keys gathered from the cp "
                         f"ranks is not the batch-invariant kernel's; exact mode runs cp=1")
    from tidal.modeling.moe import FAMILIES

    model_type = _model_type(cfg.model.path)
    if model_type in FAMILIES:
        raise ValueError(f"{field} with a mixture-of-experts model ({model_type}): a split row's "
                         f"recorded routing is not built; set trainer.cp=1")


def check_partial(cfg: RunConfig, *, dynamic_sampling: bool) -> None:
    """Partial rollouts (generator.partial_rollout_tokens) against what they cannot work with."""
    n, g = cfg.generator.partial_rollout_tokens, cfg.generator
    if n is None:
        return
    field = f"generator.partial_rollout_tokens={n}"
    longest = cfg.response_tokens  # multi-turn: the whole episode's, turns and observations
    if n >= longest:
        limit = (f"generator.max_new_tokens={longest}" if longest == g.max_new_tokens else
                 f"a response's {longest} tokens (multi_turn.max_total_tokens)")
        raise ValueError(f"{field} is not below {limit}: no sample would ever be cut; set it lower (e.g. "
                         f"{max(1, longest // 4)}) or leave it unset")
    if cfg.rollout == "multi_turn":
        from tidal.executors.environments.base import env_class

        if why := ENGINES.get(g.engine).no_turn_cuts:
            raise ValueError(f"{field} with rollout=multi_turn and generator.engine={g.engine}: {why}; "
                             f"{ENGINES.offer(lambda e: not e.no_turn_cuts)}")
        spec = cfg.multi_turn.env or "lookup"
        if not getattr(env_class(spec), "resumable", True):
            raise ValueError(f"{field} with multi_turn.env={spec}: that environment says it cannot be saved and "
                             f"restored (resumable = False), and a cut episode resumes from its saved state in a "
                             f"later step; leave generator.partial_rollout_tokens unset")
    if dynamic_sampling:
        raise ValueError(f"{field} with dynamic sampling (algorithm.dynamic_sampling=true): its top-ups fill a step "
                         f"with the groups that step finished, and partial rollouts move groups to later steps")
    for name, section in (("trainer", cfg.trainer), ("critic", cfg.critic)):
        if section.mini_batches > 1:
            raise ValueError(f"{field} with {name}.mini_batches={section.mini_batches}: the groups a step trains are "
                             f"the ones that ended in it (their number varies), so a mini-batch could be empty")


def check_moe(cfg: RunConfig, *, critic: bool) -> None:
    """Mixture-of-experts options (trainer.ep, trainer.routing_replay) against the model and the layout."""
    t = cfg.trainer
    asked = [f"trainer.ep={t.ep}"] * (t.ep > 1) + ["trainer.routing_replay=true"] * t.routing_replay
    if critic and cfg.critic.ep > 1:
        raise ValueError(f"critic.ep={cfg.critic.ep}: expert parallel is built for the trainer's policy only; "
                         f"set critic.ep=1")
    from tidal.modeling.moe import FAMILIES, check_ep, moe_shape

    if not asked and _model_type(cfg.model.path) not in FAMILIES:
        return  # a dense model (the embedded one too): nothing to check, no config class to load
    config = load_config(cfg.model.path)
    shape = moe_shape(config)
    if shape is not None and getattr(config, "output_router_logits", False):
        raise ValueError(f"{cfg.model.path}/config.json asks for the load-balancing auxiliary loss "
                         f"(output_router_logits: true), which is not part of Tidal's objective; set it to false "
                         f"there (RL fine-tuning trains the routing the policy samples with)")
    if not asked:
        return
    if shape is None:
        raise ValueError(f"{' and '.join(asked)}: the model (model_type {getattr(config, 'model_type', None)!r}) "
                         f"is dense, it has no experts to split or routing to replay")
    if t.ep > 1:
        check_ep(shape.experts, ep=t.ep)
        if t.dp % t.ep:
            raise ValueError(f"trainer.ep={t.ep} must divide trainer.dp={t.dp}: each run of ep dp ranks splits the "
                             f"experts once")
        if t.tp > 1 or t.fsdp:
            raise ValueError(f"trainer.ep={t.ep} with trainer.tp={t.tp}, trainer.fsdp={t.fsdp}: expert parallel runs "
                             f"with tp=1 and without fsdp (the dense weights replicated over dp)")
        if not BACKENDS.get(t.backend).expert_parallel:
            raise ValueError(f"trainer.ep={t.ep} with trainer.backend={t.backend}: that backend has no expert "
                             f"parallel; {BACKENDS.offer(lambda b: b.expert_parallel)}")
    if t.routing_replay:
        why = ENGINES.get(cfg.generator.engine).no_routing
        if why:
            raise ValueError(f"trainer.routing_replay=true with generator.engine={cfg.generator.engine}: {why}; "
                             f"{ENGINES.offer(lambda e: not e.no_routing)}")
        if cfg.rollout != "single_turn" or cfg.generator.partial_rollout_tokens is not None:
            raise ValueError("trainer.routing_replay=true is built for single-turn rollouts generated whole: a "
                             "multi-turn observation and a resumed partial rollout are fed without recording their "
                             "routing")


def check_lora(cfg: RunConfig) -> None:
    """trainer.lora against the layout, the engine and the model's modules."""
    t, lora = cfg.trainer, cfg.trainer.lora
    if not lora.on:
        return
    field = f"trainer.lora.rank={lora.rank}"
    if not BACKENDS.get(t.backend).lora:
        raise ValueError(f"{field} with trainer.backend={t.backend}: that backend trains no LoRA adapters; "
                         f"{BACKENDS.offer(lambda b: b.lora)}")
    if t.tp > 1 or t.fsdp or cfg.generator.tp > 1:
        raise ValueError(f"{field} with trainer.tp={t.tp}, trainer.fsdp={t.fsdp}, generator.tp={cfg.generator.tp}: "
                         f"LoRA runs with tp=1 and without fsdp (the frozen base replicated over dp)")
    if t.precision != "fp32":
        raise ValueError(f"{field} with trainer.precision={t.precision}: a LoRA run keeps no fp32 master copy of the frozen "
                         f"base; use model.dtype=bfloat16 for a bf16 base (the adapters train in its dtype)")
    from tidal.modeling.lora import check_targets

    check_targets(load_config(cfg.model.path), lora)


def load_config(path: str | None):
    """config.json as transformers reads it, loaded once for every check (tidal/modeling/hf.py `load_config`);
    imported here, when a check asks, so the CLI's import stays light."""
    from tidal.modeling.hf import load_config as load

    return load(path)


def _model_type(path: str | None) -> str | None:
    """config.json's model_type, read as JSON (None: the embedded model, or no readable config.json:
    tidal/launch/preflight.py names that)."""
    try:
        return json.loads(Path(path, "config.json").read_text()).get("model_type") if path else None
    except (OSError, ValueError, AttributeError):
        return None


def check_critic(cfg: RunConfig) -> None:
    c = cfg.critic
    if c.mini_batches * c.dp > cfg.data.prompts_per_step:
        raise ValueError(f"critic.mini_batches ({c.mini_batches}) x critic.dp ({c.dp}) exceeds "
                         f"data.prompts_per_step ({cfg.data.prompts_per_step}): a mini-batch would be empty")
    if c.precision == "fp16":
        raise ValueError("critic.precision=fp16: the critic has no loss scale (fp16 is the trainer's alone); "
                         "use critic.precision=bf16 or fp32")
    if c.precision == "bf16" and cfg.model.dtype != "float32":
        raise ValueError("critic.precision=bf16 keeps float32 master weights: it needs model.dtype=float32 "
                         f"(got {cfg.model.dtype})")


def check_tp(cfg: RunConfig, *, critic: bool = False) -> None:
    """tp sizes against the model (the world size is checked at launch)."""
    sizes = {"trainer.tp": cfg.trainer.tp, "generator.tp": cfg.generator.tp} | ({"critic.tp": cfg.critic.tp} if critic else {})
    if all(tp == 1 for tp in sizes.values()):
        return
    from tidal.modeling.parallel.tp import check_tp as fits

    config = load_config(cfg.model.path)
    for field, tp in sizes.items():
        try:
            fits(config, tp=tp)
        except ValueError as exc:
            raise ValueError(f"{field}={tp} does not fit the model: {exc}") from None


def check_placement(cfg: RunConfig, *, critic: bool) -> None:
    """placement=colocated (tidal/controller/colocate.py): one set of ranks for every executor, taking turns."""
    if cfg.placement != "colocated":
        return
    g, ranks = cfg.generator, cfg.generator.replicas * cfg.generator.tp
    if cfg.schedule.kind != "sync":
        raise ValueError(f"placement=colocated with schedule {cfg.schedule.kind}: co-located executors take turns on "
                         f"each device, so training cannot run while generation goes on; use --schedule sync "
                         f"(periodic and offpolicy overlap the two on separate ranks: placement=split)")
    learners = [("trainer", cfg.trainer)] + ([("critic", cfg.critic)] if critic else [])
    for name, learner in learners:
        if learner.dp * learner.ranks_per_unit != ranks:
            pp = (f" x {name}.pp", f" x {learner.stages}") if learner.stages > 1 else ("", "")
            if learner.cp > 1:
                pp = (f"{pp[0]} x {name}.cp", f"{pp[1]} x {learner.cp}")
            raise ValueError(f"placement=colocated: {name}.dp x {name}.tp{pp[0]} = {learner.dp} x {learner.tp}{pp[1]} must equal "
                             f"generator.replicas x generator.tp = {g.replicas} x {g.tp}: co-located executors "
                             f"share every rank")
    if cfg.reward.model is not None:
        raise ValueError("placement=colocated with reward.model is not supported: the reward model's own ranks "
                         "(reward.model.replicas) would need their own turn on the device; use placement=split")
    from tidal.controller.devices import detect_device  # where this job's ranks will run

    device = detect_device().type
    why = ENGINES.get(g.engine).no_release(device)
    if why:
        raise ValueError(f"placement=colocated with generator.engine={g.engine}: {why}; "
                         f"{ENGINES.offer(lambda e: not e.no_release(device))} or placement=split")


def check_engine(cfg: RunConfig) -> None:
    """The engine's limits, before any rank starts (tidal/executors/generator/engines.py)."""
    g, engine = cfg.generator, ENGINES.get(cfg.generator.engine)
    if g.kv_budget_tokens is not None:
        if engine.kv_note:  # an engine that sizes its own KV cache
            raise ValueError(f"generator.kv_budget_tokens is the native engine's; generator.engine={g.engine} sizes its "
                             f"own: {engine.kv_note}")
        # the longest group a step can bring: G samples of the longest prompt and response
        need = g.samples_per_prompt * (cfg.data.max_prompt_tokens + cfg.response_tokens)
        if g.kv_budget_tokens < need:
            raise ValueError(f"generator.kv_budget_tokens={g.kv_budget_tokens} cannot hold one group: G="
                             f"{g.samples_per_prompt} samples x (data.max_prompt_tokens={cfg.data.max_prompt_tokens} + "
                             f"{cfg.response_tokens} response tokens) = {need}")
    engine.check(g, cfg.model.path)


def check_numerics(cfg: RunConfig) -> None:
    """model.numerics=exact (tidal/modeling/numerics.py) against what it does not cover, one line each."""
    if cfg.model.numerics != "exact":
        return
    field, g, t = "model.numerics=exact", cfg.generator, cfg.trainer
    # by capability (tidal/executors/generator/engines.py, tidal/executors/trainer/backends.py), never by name
    if not ENGINES.get(g.engine).exact:
        raise ValueError(f"{field} with generator.engine={g.engine}: that engine's kernels are not the trainer's "
                         f"batch-invariant ones (docs/numerics.md); "
                         f"{ENGINES.offer(lambda e: e.exact)}")
    if not BACKENDS.get(t.backend).exact:
        raise ValueError(f"{field} with trainer.backend={t.backend}: that backend's layers are not batch-invariant "
                         f"(docs/numerics.md); {BACKENDS.offer(lambda b: b.exact)}")
    for name, tp in (("generator.tp", g.tp), ("trainer.tp", t.tp), ("trainer.ep", t.ep)):
        if tp > 1:
            raise ValueError(f"{field} with {name}={tp}: a sharded product ends in an all-reduce whose order is not "
                             f"the single device's; exact mode runs tp=1 and ep=1 (dp and FSDP are fine)")
    from tidal.modeling.numerics import check_model

    check_model(load_config(cfg.model.path))


def check_groups(cfg: RunConfig) -> None:
    """One sample per prompt under a group-relative advantage: every advantage is exactly 0 (the
    group's mean is its only sample), so the run would spend its compute training nothing."""
    g = cfg.generator.samples_per_prompt
    if g < 2 and cfg.algo_config is not None and cfg.algo_config.group_relative:
        raise ValueError(f"generator.samples_per_prompt={g} with --algo {cfg.algo}: its advantages compare each "
                         f"sample with the others of its prompt's group, so every advantage would be 0 and nothing "
                         f"would train; set generator.samples_per_prompt to 2 or more")
    if g >= 2 and cfg.generator.temperature == 0 and cfg.algo_config is not None and cfg.algo_config.group_relative:
        raise ValueError(f"generator.temperature=0 (greedy) with --algo {cfg.algo}: the {g} samples of a prompt are "
                         f"the same text, so every group-relative advantage would be 0 and nothing would train; "
                         f"sample with a temperature > 0 (greedy suits evaluation)")


def check_eval(cfg: RunConfig) -> None:
    e = cfg.eval
    if not e.every:
        return
    if e.path is None and cfg.data.path is not None:
        raise ValueError("eval.every needs eval.path with a data file: the held-out split without one is the "
                         "embedded task's")
    if e.samples > 1 and e.temperature == 0:
        raise ValueError(f"eval.samples={e.samples} with eval.temperature=0: greedy samples are all the same text; "
                         f"set eval.temperature > 0 for pass@{e.samples}, or eval.samples=1")


def check_rollout(cfg: RunConfig) -> None:
    """A multi-turn rollout's environment loads (module:Class imported here, so a typo fails before
    any rank starts), and it fits the rest of the config."""
    if cfg.rollout != "multi_turn":
        return
    from tidal.executors.environments.base import env_class

    m = cfg.multi_turn
    env = env_class(m.env or "lookup")
    if m.env in (None, "lookup") and cfg.data.path is not None:
        raise ValueError("rollout=multi_turn with a data file needs multi_turn.env (calculator, python or "
                         "module:Class): the default, lookup, is the embedded task's environment")
    if cfg.generator.tp > 1 and not getattr(env, "deterministic", True):
        raise ValueError(f"multi_turn.env={m.env!r} is not deterministic, and generator.tp={cfg.generator.tp}: every tp "
                         f"rank of a replica steps its own copy of the environment, and they must agree")
    if cfg.generator.tp > 1 and not getattr(env, "inline", False) and m.env_workers != 0:
        # the ranks' forwards are one collective: each must feed the same samples, so take each answer (and each
        # first observation) at the same iteration, which calls on threads do not promise
        raise ValueError(f"multi_turn.env={m.env or 'lookup'} with generator.tp={cfg.generator.tp}: every tp rank of a "
                         f"replica calls its own copy of the environment, off the decode loop, so an answer may reach "
                         f"one rank an iteration before another and their forwards would differ; set "
                         f"multi_turn.env_workers=0 (calls inline: every rank takes an answer at the same iteration)")
    if m.total_tokens(cfg.generator.max_new_tokens) <= cfg.generator.max_new_tokens:
        raise ValueError(f"multi_turn.max_total_tokens={m.max_total_tokens} leaves no room for an observation after a "
                         f"turn of generator.max_new_tokens={cfg.generator.max_new_tokens}")
