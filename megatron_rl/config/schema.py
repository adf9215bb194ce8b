"""Structured configs: one dataclass per group of names users type (see DESIGN.md).

Every field here is overridable from the command line, e.g. ``trainer.total_steps=50``.
Validation of values lives in ``validate.py`` so that these stay plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class ModelConfig:
    # llama: RMSNorm + SwiGLU + RoPE, no biases; qwen2: the same plus q/k/v biases; qwen3: per-head
    # q/k RMSNorm, no biases; qwen2_moe, qwen3_moe, mixtral: their MoE counterparts (set num_experts).
    # With model.path, family and sizes come from the checkpoint's config.json.
    family: str = "llama"
    # Hugging Face or Megatron checkpoint to start from; None builds a random-init model.
    path: Optional[str] = None
    # Transformer layers (random-init models; with model.path the checkpoint's).
    num_layers: int = 2
    # Width of the residual stream.
    hidden_size: int = 64
    # Query heads per attention layer.
    num_attention_heads: int = 4
    # Key/value heads (grouped-query attention); equal to num_attention_heads for plain multi-head.
    num_query_groups: int = 2
    # Hidden size of the dense MLP (SwiGLU).
    ffn_hidden_size: int = 128
    # Longest sequence (prompt + response) the model and the engine's KV cache hold.
    max_position_embeddings: int = 64
    # Size of one attention head; None: hidden_size / num_attention_heads (Qwen3 sets it apart).
    head_dim: Optional[int] = None
    # RoPE base frequency (theta).
    rotary_base: float = 10000.0
    # Llama 3.x RoPE frequency scaling factor; None: plain RoPE.
    rope_scaling_factor: Optional[float] = None
    # Llama 3.x RoPE scaling: wavelengths longer than original context / low factor are divided by
    # rope_scaling_factor (used only with model.rope_scaling_factor).
    rope_low_freq_factor: float = 1.0
    # Llama 3.x RoPE scaling: wavelengths shorter than original context / high factor are kept.
    rope_high_freq_factor: float = 4.0
    # Llama 3.x RoPE scaling: the context the model was pretrained at (original_max_position_embeddings).
    rope_original_max_position_embeddings: int = 8192
    # Epsilon of the RMSNorm layers.
    norm_epsilon: float = 1e-6
    # Share the input embedding with the output projection.
    tie_word_embeddings: bool = False
    # Standard deviation of the random weight initialisation.
    init_method_std: float = 0.02
    # Precision of parameters and compute: fp32 | bf16.
    dtype: str = "fp32"
    # On a GPU, fused element-wise kernels where they need no TransformerEngine (SwiGLU and RoPE
    # compiled by torch.compile); false keeps the eager kernels. Ignored on a CPU (always off).
    fused_kernels: bool = True
    # Mixture of experts: 0 keeps a dense MLP in every layer.
    num_experts: int = 0
    # Experts each token is routed to.
    moe_router_topk: int = 2
    # Hidden size of one routed expert; None uses ffn_hidden_size (Mixtral).
    moe_ffn_hidden_size: Optional[int] = None
    # true: softmax over the chosen top-k logits, i.e. weights renormalised to sum to 1 (Mixtral,
    # Qwen3-MoE with norm_topk_prob); false: softmax over all experts, then top-k (Qwen2-MoE).
    moe_norm_topk_prob: bool = True
    # One entry per layer, 1 = MoE, 0 = dense MLP of ffn_hidden_size; None: every layer is MoE.
    moe_layer_pattern: Optional[List[int]] = None
    # Always-on shared expert of this hidden size beside the routed ones (Qwen2-MoE); 0 = none.
    moe_shared_expert_ffn_hidden_size: int = 0
    # Scale the shared expert's output by sigmoid(x . w) (Qwen2-MoE's shared_expert_gate).
    moe_shared_expert_gate: bool = False
    # Load-balancing auxiliary loss coefficient; 0 trains without it.
    moe_aux_loss_coeff: float = 0.0
    # alltoall | allgather: how tokens travel to experts on other expert-parallel ranks.
    moe_token_dispatcher: str = "alltoall"
    # true: a layer's local experts run as one grouped matmul per projection (torch._grouped_mm;
    # bf16 on Hopper GPUs, any float dtype on CPU), routed on the device without host syncs when
    # one rank holds all experts; false: megatron-core's SequentialMLP loop over experts. Same
    # parameters and checkpoints either way.
    moe_grouped_experts: bool = True
    # Router scores: softmax | sigmoid (DeepSeek-V3: sigmoid, a per-expert bias that only steers the
    # choice, experts chosen within the best moe_router_group_topk of moe_router_num_groups groups,
    # weights renormalised then scaled by moe_router_topk_scaling_factor).
    moe_router_score_function: str = "softmax"
    # Per-expert score-correction bias that steers the choice only (DeepSeek-V3).
    moe_router_expert_bias: bool = False
    # Expert groups for group-limited routing (DeepSeek-V3); null: no groups.
    moe_router_num_groups: Optional[int] = None
    # Groups a token's experts may come from (DeepSeek-V3); null: all.
    moe_router_group_topk: Optional[int] = None
    # Factor on the renormalised routing weights (DeepSeek-V3); null: 1.
    moe_router_topk_scaling_factor: Optional[float] = None
    # Multi-head latent attention (DeepSeek-V3), used when kv_lora_rank is set; q_lora_rank None
    # projects queries directly.
    q_lora_rank: Optional[int] = None
    # Latent size of the compressed keys/values; setting it turns on multi-head latent attention.
    kv_lora_rank: Optional[int] = None
    # MLA: per-head query/key dimensions without rotary embedding.
    qk_nope_head_dim: int = 128
    # MLA: per-head query/key dimensions with rotary embedding.
    qk_rope_head_dim: int = 64
    # MLA: per-head value dimension.
    v_head_dim: int = 128
    # YaRN RoPE (DeepSeek-V3); yarn_factor None: plain RoPE.
    yarn_factor: Optional[float] = None
    # YaRN: the context length the model was pre-trained at.
    yarn_original_max_position_embeddings: int = 4096
    # YaRN: high-frequency boundary of the interpolation ramp.
    yarn_beta_fast: float = 32.0
    # YaRN: low-frequency boundary of the interpolation ramp.
    yarn_beta_slow: float = 1.0
    # YaRN: attention-temperature scale.
    yarn_mscale: float = 1.0
    # YaRN: attention-temperature scale applied over all dimensions (DeepSeek-V3).
    yarn_mscale_all_dim: float = 0.0


@dataclass
class LearnerConfig:
    # Tensor-parallel size of the learner (torchrun world only; one process needs 1).
    tp: int = 1
    # Pipeline-parallel size of the learner (torchrun world only).
    pp: int = 1
    # Expert-parallel size of the learner, for MoE models (torchrun world only).
    ep: int = 1
    # Context-parallel size of the learner; > 1 needs TransformerEngine (CUDA).
    cp: int = 1
    # Derived from the world size when omitted.
    dp: Optional[int] = None
    # Peak learning rate of the policy.
    lr: float = 1e-3
    # Steps of linear warm-up from 0 to lr.
    lr_warmup_steps: int = 0
    # After warm-up: constant | linear | cosine, from lr down to min_lr at trainer.total_steps.
    lr_decay_style: str = "constant"
    # Learning rate at the end of the decay.
    min_lr: float = 0.0
    # The step where the decay reaches min_lr, if not trainer.total_steps (Megatron's
    # --lr-decay-iters): a run continued past it, or a longer run that must follow a shorter
    # one's schedule step for step, stays at min_lr from there.
    lr_decay_steps: Optional[int] = None
    # AdamW weight decay.
    weight_decay: float = 0.0
    # AdamW beta1.
    adam_beta1: float = 0.9
    # AdamW beta2.
    adam_beta2: float = 0.999
    # AdamW epsilon.
    adam_eps: float = 1e-8
    # Gradient-norm clip; 0 disables.
    clip_grad: float = 1.0
    # An optimizer step whose loss or gradient norm is not finite is skipped (counted in
    # train/skipped_steps); this many skipped in a row stop the run (0: never stop).
    max_skipped_steps: int = 5
    # Token budget of one micro-batch (prompt + response tokens, padding included).
    micro_batch_tokens: int = 4096
    # Without a pipeline, a batch is cut into micro-batches of similar lengths, trading padding
    # against the fixed cost of each micro-batch, given here in padded tokens. None: 256 on a CPU,
    # 4096 on a GPU (where a token costs far less next to a forward's fixed work); measured in
    # learner/batch.py's docstring.
    micro_batch_overhead_tokens: Optional[int] = None
    # Recompute each transformer layer's activations during the backward (megatron-core's full
    # recompute, one layer at a time): far less activation memory for about a third more compute.
    recompute_activations: bool = False
    # Train each prompt once per micro-batch: a GRPO group's responses follow one copy of their
    # prompt and attend to it (models/shared_prefix.py), instead of G rows of prompt + response.
    # Same losses and gradients, fewer tokens: a CPU learner's step 1.4x faster on longtail_cpu.
    # CPU learners only for now (on a GPU the segment attention has no flash kernel and measured
    # 2-3x slower); no pipeline, context or expert parallelism, no multi-head latent attention.
    share_prompts: bool = False
    # PPO epochs over each batch (mini-batches split the batch into optimizer steps).
    ppo_epochs: int = 1
    # Optimizer steps per batch per epoch: the batch's groups are split into this many mini-batches
    # (must divide algo.groups_per_batch).
    mini_batches: int = 1
    # Shard optimizer state over data-parallel ranks (Megatron's DistributedOptimizer).
    use_distributed_optimizer: bool = False


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA) on the policy's linear projections: each adapted weight W stays
    frozen in model.dtype and the model computes W·x + (alpha / rank)·B·A·x with A and B trained in
    fp32 (B starts at zero, so training starts from the base model). The optimizer, gradient
    buffers and optimizer state hold the adapters only; engines receive the adapters (lora.sync).
    tools/export_lora.py writes the adapters as a PEFT directory, tools/merge_lora.py a merged model."""
    # Rank of each adapter (the inner size of B·A); 0 trains every weight (no LoRA).
    rank: int = 0
    # Scale numerator: the low-rank update is multiplied by alpha / rank.
    alpha: float = 32.0
    # Dropout probability on each adapter's input during training (0: none).
    dropout: float = 0.0
    # Projections that get an adapter, in every transformer layer: linear_qkv (fused
    # query/key/value), linear_proj (attention output), linear_fc1 (fused gate/up of the MLP),
    # linear_fc2 (MLP down). An MoE model's MLPs are its routed experts: attention only there.
    targets: List[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    # What a weight sync sends. adapters: the engine carries the adapters; the first sync sends the
    # frozen base and the adapters, each later one the adapters alone. The embedded engine (every
    # placement) applies them unmerged (no merged weight rounded to model.dtype); vLLM (every
    # placement) serves them as a LoRA of its own (started with LoRA enabled). merged:
    # W + (alpha / rank)·B·A, computed in fp32 and cast to model.dtype, the whole model every sync.
    # Another registered engine receives merged weights either way (one warning line at start).
    sync: str = "adapters"


@dataclass
class RolloutConfig:
    # embedded | vllm (an entry in rollout/build.py's ENGINES: how it is built, hosted and checked)
    engine: str = "embedded"
    # How a prompt becomes its group of trajectories: single_turn (one response per sample), an
    # agent by name (calculator_agent) or by import path (my_pkg.agents:MyAgent); docs/agents.md.
    workflow: str = "single_turn"
    # Agents: keyword arguments of the agent class's constructor, e.g. rollout.agent_args.max_turns=5
    # or rollout.agent_args={max_turns:5,tools:[python]} (empty: constructed with none).
    agent_args: Dict[str, Any] = field(default_factory=dict)
    # Agents: each trajectory of a run gets the run's advantage times turn_discount ** (model
    # turns after it), so earlier turns get less credit; 1 gives every turn the same.
    turn_discount: float = 1.0
    # Rollout engines (torchrun world only; one process runs one).
    engines: int = 1
    # Tensor-parallel size of each engine (the embedded engine runs at 1).
    tp: int = 1
    # colocated (every learner rank also hosts an engine) | disaggregated (engines on ranks of their
    # own; torchrun world only).
    placement: str = "colocated"
    # Sampling temperature; the recorded logprobs are of the tempered distribution.
    temperature: float = 1.0
    # Nucleus sampling threshold in (0, 1]; 1 disables.
    top_p: float = 1.0
    # 0 disables top-k.
    top_k: int = 0
    # Longest response, in tokens.
    max_new_tokens: int = 16
    # Largest decode batch of the embedded engine.
    max_batch_size: int = 256
    # Tokens of prompt + response one row of the embedded engine's KV cache holds. Default: the
    # longest a single-turn rollout needs (data.max_prompt_tokens + rollout.max_new_tokens), or
    # model.max_position_embeddings for agents (their context grows turn by turn). A checkpoint's
    # max_position_embeddings (40,960 for Qwen3) would make the cache far larger than rollouts use.
    max_model_len: Optional[int] = None
    # After a weight update, recompute the KV cache of requests in flight under the new weights
    # (AReaL-style: every later token is exactly the new policy's) instead of keeping the old
    # entries (vLLM-style: cheaper; the recorded behaviour logprobs are still the ones sampled
    # from, which is what the decoupled loss corrects for).
    recompute_kv_on_update: bool = False
    # On a GPU, the embedded engine replays each decode step from a CUDA graph (one per batch and
    # cache-width bucket, all captured when the engine starts) instead of launching its ~2,000 kernels from
    # Python; MoE too where its layers run on the grouped device path (bf16 on Hopper), and
    # multi-latent attention (DeepSeek-V3). Ignored on a CPU.
    cuda_graphs: bool = True
    # A mixture-of-experts embedded engine records each MoE layer's chosen experts for every
    # position it computes and returns them with the response (routing replay); no effect on
    # dense models.
    record_routing: bool = True
    # Each request draws from its own random stream, seeded by trainer.seed and its request id, so
    # its tokens do not depend on which engine or batch serves it (two engines reproduce a
    # one-engine run). Costs one hash per vocab entry per row per decode step.
    seed_by_request: bool = False
    # Run the embedded engine in a child process: its own Python interpreter, so on a CPU its
    # decode loop and the learner's step do not take turns on one interpreter lock. (In the
    # torchrun world every engine has a process of its own: a learner rank's child, or its rank.)
    separate_process: bool = False
    # Where that engine process computes: auto (the learner's device) | cuda:N (GPU N, e.g. cuda:1
    # for learner on cuda:0 and engine on cuda:1: disaggregated on one machine). Needs
    # separate_process=true; a GPU the machine lacks is an error when the engine starts.
    device: str = "auto"
    # How new weights reach vLLM engines: broadcast (buckets over a process group that vLLM's
    # workers join: gloo on CPUs, NCCL on GPUs; no file) | file (a safetensors file in /dev/shm,
    # reloaded; the fallback). Embedded engines take them in memory either way.
    weight_transport: str = "broadcast"
    # A weight transfer to an engine that takes longer than this fails the run (seconds).
    weight_timeout_s: float = 600.0
    # After each weight update, every engine samples a short fixed probe and the learner scores
    # the same tokens: the largest logprob gap is logged as sync/probe_gap (a check that the
    # engines serve the learner's weights; costs one small request and forward per update).
    check_sync: bool = False
    # Benchmarks only (rollout/long_tail.py): > 0 gives every request of the embedded engine a
    # response length drawn from a log-normal of this median (tokens) and 99th percentile
    # rollout.long_tail_p99, capped at rollout.max_new_tokens, its stop tokens ignored until then,
    # so random weights produce the long tail of reasoning models' responses. 0: off.
    long_tail_median: int = 0
    # The 99th percentile of those lengths (tokens), > rollout.long_tail_median.
    long_tail_p99: int = 16384


@dataclass
class SchedulerConfig:
    # η: how many policy versions a trained sample may lag behind. 0 is the synchronous
    # on-policy loop: one batch generated per version, trained, published.
    max_staleness: int = 0
    # Most groups generating at once, whatever the staleness bound allows.
    max_concurrent_rollouts: int = 1024
    # Groups running or waiting to be trained, in batches (algo.groups_per_batch each): 2 lets the
    # engine fill one batch while the learner's next is finishing (a long response does not stall
    # it) without racing η versions ahead when the learner is the slower side. A fraction keeps
    # that part of a batch more in flight (1.5: half a batch), so the learner takes a batch when
    # B groups are done instead of waiting for the slowest. 0: no limit but η; else >= 1.
    max_ahead_batches: float = 2
    # A group that would be trained staler than η (a long response still generating while newer
    # groups finish): wait: the learner waits for it (time/learner_held_s), so every response
    # length is trained as often as it is generated; retry: it is dropped and its prompt retried
    # (queue/returned_stale_total), the learner never waits, but a long-tailed workload then
    # trains its long responses less (a length bias) and wastes their generation.
    overdue: str = "wait"


@dataclass
class AlgoConfig:
    # The advantage estimator: grpo (group mean/std) | dr_grpo (group mean only) | rloo
    # (leave-one-out mean) | reinforce_pp (returns whitened over the batch's tokens) |
    # reinforce_pp_baseline (group mean subtracted first) | gae (PPO with a critic: per-token
    # GAE advantages from a Megatron value model trained alongside, see `critic`).
    name: str = "grpo"
    # Samples (responses) per prompt; group-relative estimators need >= 2.
    group_size: int = 8
    # Groups (prompts) per training batch; each contributes group_size samples.
    groups_per_batch: int = 16
    # PPO clip below: the ratio is clipped at 1 - clip_low.
    clip_low: float = 0.2
    # PPO clip above: the ratio is clipped at 1 + clip_high (clip-higher when > clip_low).
    clip_high: float = 0.2
    # decoupled: trust region around the learner's proximal policy, importance-weighted against
    # the behaviour policy that sampled (right for stale samples); ppo: plain clipped surrogate;
    # gspo: sequence-level ratio and clip (set clip_low/high ~3e-4/4e-4, loss_agg_mode=seq-mean-token-mean).
    policy_loss: str = "decoupled"
    # > 1: dual clip of negative-advantage tokens (ppo and decoupled); 0 disables.
    dual_clip: float = 0.0
    # cispo: leave out the tokens PPO's clip would drop (A > 0 with r > 1 + clip_high, A < 0 with
    # r < 1 - clip_low), the token mask of the MiniMax-M1 paper's unified objective; false: plain
    # CISPO, every token keeps its gradient.
    cispo_trust_mask: bool = False
    # DAPO dynamic sampling: drop groups whose rewards are all equal and admit more prompts until
    # the batch is full (counted in queue/filtered_total); the run stops after
    # filter_max_batches batches' worth of groups in a row are filtered.
    filter_groups: bool = False
    # With filter_groups: stop the run after this many batches' worth of groups in a row were filtered
    # out.
    filter_max_batches: int = 20
    # Tokens with π_prox/π_behav above this are left out of the loss (0 disables the cap).
    behav_imp_weight_cap: float = 5.0
    # decoupled loss: importance weight π_prox/π_behav per token (tokens above the cap dropped) or
    # per sequence (the response's product of ratios, truncated at the cap; corrects for the
    # prefixes a stale policy visited).
    behav_weight_level: str = "token"
    # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm (Dr.GRPO:
    # token sums over a constant, rollout.max_new_tokens).
    loss_agg_mode: str = "token-mean"
    # Divide group-centred rewards by the group std (GRPO); False gives Dr.GRPO-style centring.
    normalize_adv_by_std: bool = True
    # Added to the group std before dividing by it.
    adv_eps: float = 1e-6
    # Weight of the KL penalty to the frozen initial policy; 0 disables it (and the reference model).
    kl_coef: float = 0.0
    # Estimator of the KL to the initial policy: k1 | k2 | k3 (Schulman's approximations).
    kl_estimator: str = "k3"
    # Charge the KL to each sequence's reward (before advantages) instead of adding it to the loss.
    kl_in_reward: bool = False
    # Weight of the entropy bonus; 0 disables.
    entropy_coef: float = 0.0
    # GAE (algo.name=gae): discount and λ; the outcome reward arrives at the last response token.
    gamma: float = 1.0
    # GAE lambda (algo.name=gae).
    lam: float = 1.0
    # Whiten GAE advantages over the batch's trained tokens.
    gae_whiten: bool = True
    # Mixture-of-experts routing replay (R3): rollout makes every learner forward of a sample
    # (proximal logprobs, the update, the reference model) route each token to the experts the
    # rollout engine chose for it, recorded per MoE layer with the trajectory; none lets the
    # learner's router choose (its agreement with the engine is still logged as
    # moe/router_agreement when the engine recorded routing). auto: rollout for an MoE model with
    # the embedded engine, none otherwise. The vLLM engine does not return routing.
    routing_replay: str = "auto"


@dataclass
class CorrectionConfig:
    """Rollout correction (algorithms/rollout_correction.py): weights and masks from the ratio
    ρ = π_prox / π_behav of the learner's proximal policy to the engine's that sampled each token
    (staleness and engine/learner mismatch). Every option works with every policy loss, except
    that algo.policy_loss=decoupled already weights tokens by ρ (its own cap)."""
    # Truncated importance weight: none | token (min(ρ_t, is_cap) per token) | sequence (the
    # response's product of ratios, min(Π ρ_t, is_cap), on every token of it).
    is_level: str = "none"
    # Upper bound of the importance weight (is_level).
    is_cap: float = 2.0
    # Rejection (masked IS): none | token (tokens with ρ_t outside [reject_low, reject_high] leave
    # the loss) | sequence (responses whose Π ρ_t is outside) | geometric (responses whose
    # geometric mean exp(mean log ρ_t) is outside; length-independent, use a narrow band such as
    # [0.999, 1.001]). IcePop: reject=token reject_low=0.5 reject_high=5 with is_level=token is_cap=5.
    reject: str = "none"
    # Lower edge of the kept band (None: 1 / reject_high).
    reject_low: Optional[float] = None
    # Upper edge of the kept band.
    reject_high: float = 2.0
    # > 0: leave out a whole response if any token has ρ_t below this (e.g. 1e-4); 0 disables.
    veto_below: float = 0.0
    # > 0: leave out tokens sampled more than this many policy versions before the weights being
    # trained (each token's version is recorded); 0 keeps all (scheduler.max_staleness bounds them).
    max_version_gap: int = 0


@dataclass
class TeacherConfig:
    """On-policy distillation (algo.name=opd): a frozen teacher scores the tokens the student
    sampled, on the learner ranks with the learner's parallel layout."""
    # The teacher's checkpoint: a Hugging Face directory or a Megatron checkpoint of this run's
    # kind; its architecture is its own, its vocabulary must be the student's (same tokenizer).
    path: Optional[str] = None
    # Several teachers, one per kind of row: {name: checkpoint} (each as teacher.path), every row
    # scored by the teacher that its teacher.field names, e.g.
    # 'teacher.paths={math: /ckpt/math-hf, code: /ckpt/code-hf}' teacher.field=data_source.
    # Instead of teacher.path; each is built once, frozen, with the learner's layout.
    paths: Dict[str, str] = field(default_factory=dict)
    # The dataset row field that names each row's teacher (a key of teacher.paths).
    field: Optional[str] = None
    # The teacher (a key of teacher.paths) of rows without teacher.field or with it empty; None:
    # such a row is an error.
    default: Optional[str] = None
    # Weight of the reward's group advantage added to the per-token distillation advantage
    # log π_teacher - log π_student (0: distillation alone).
    reward_weight: float = 0.0


@dataclass
class CriticConfig:
    """The value model of algo.name=gae: the policy's architecture and parallel layout with a
    scalar head, trained with the learner's epochs, mini-batches and lr schedule shape."""
    # Peak learning rate (None: learner.lr); follows learner.lr_warmup_steps / lr_decay_style.
    lr: Optional[float] = None
    # Clip of the value update around the old values (PPO's clipped value loss); 0 disables.
    value_clip: float = 0.5
    # Start from the policy's weights (the trunk; the head starts at zero) instead of a fresh init.
    init_from_policy: bool = True


@dataclass
class DataConfig:
    # The prompts: reverse_digits | sort_digits (synthetic digit tasks) | arithmetic (synthetic
    # expressions such as 3+4*2= with a worked solution and a \boxed{} answer; data/arithmetic.py) |
    # file (the dataset at data.path or data.sources) | gsm8k | math500 (a file with their fields
    # and answer forms) | jsonl (the same as file).
    name: str = "reverse_digits"
    # The dataset: a JSONL file, a parquet file (verl's format) or a directory saved by Hugging
    # Face datasets' save_to_disk; the format is told by the suffix or the directory's files.
    path: Optional[str] = None
    # Several datasets mixed by weight instead of data.path: a list of {path, weight} (weights
    # relative), each optionally with its own prompt_key, answer_key, system_key, system_prompt,
    # split (default: the data.* key). Deterministic with trainer.seed, so resume continues it.
    sources: Optional[List[Dict[str, Any]]] = None
    # Field of a row holding the prompt (text or a list of chat messages); dotted for a nested
    # field. None: the dataset's own (problem for math500), else the first of question, prompt,
    # messages, problem that the first row has.
    prompt_key: Optional[str] = None
    # Field holding the reference answer: text, a number, or a list of acceptable answers; dotted
    # for a nested field (GSM8K's is cut to the number after '####'). None: the first of answer,
    # reward_model.ground_truth (verl's), ground_truth that the first row has.
    answer_key: Optional[str] = None
    # A system prompt for every row: a system message before chat prompts (unless the row's
    # messages open with one), the text and a blank line before a text template's prompt.
    system_prompt: Optional[str] = None
    # Field of a row holding its own system prompt (used instead of data.system_prompt when
    # non-empty).
    system_key: Optional[str] = None
    # The split to read from a directory that holds a saved DatasetDict.
    split: str = "train"
    # Synthetic tasks: digit-string lengths (inclusive) and alphabet.
    min_digits: int = 3
    # Synthetic tasks: longest digit string (inclusive).
    max_digits: int = 5
    # Synthetic tasks: the alphabet digit strings are drawn from.
    digits: str = "0123456789"
    # Draw each string's digits without repetition (every digit appears at most once).
    distinct_digits: bool = False
    # 0: lengths uniform in [min_digits, max_digits]. > 0: a power law, P(n) ∝ (n - min_digits + 1)^-tail,
    # so most strings are short and a few are long (long-tailed response lengths, as in reasoning RL).
    length_tail: float = 0.0
    # data.name=arithmetic: fewest operations in an expression (each one step of the worked solution).
    arithmetic_min_ops: int = 1
    # data.name=arithmetic: most operations in an expression (the difficulty: more steps to chain).
    arithmetic_max_ops: int = 2
    # data.name=arithmetic: numbers are whole numbers from 0 to this (9: one digit each).
    arithmetic_max_operand: int = 9
    # data.name=arithmetic: the operators drawn from, a subset of +-* (multiplications are done first).
    arithmetic_operators: str = "+-*"
    # plain | qa (Question/Answer framing asking for '#### <number>') | math (Problem/Solution
    # framing asking for a \boxed{} answer) | chat (the bare question as one user message through
    # the tokenizer's chat template; needs a tokenizer with one)
    template: str = "plain"
    # Send each JSONL prompt (its data.template's instruction included) as one user message
    # through the tokenizer's chat template. null: when the tokenizer has a chat template (a
    # checkpoint's); true: required; false: never (raw text, e.g. for a base model).
    apply_chat_template: Optional[bool] = None
    # auto (the checkpoint's own tokenizer when model.path holds one, or data.tokenizer_path is
    # set; otherwise char for synthetic tasks and bpe for JSONL datasets) | char (no training,
    # exact for synthetic tasks) | bpe (byte-level BPE trained offline on the dataset) | model
    # (the checkpoint's tokenizer.json, special tokens, chat template and stop ids). The run's
    # config.yaml records the choice auto made.
    tokenizer: str = "auto"
    # Read the checkpoint tokenizer from this Hugging Face directory instead of model.path (e.g. a
    # random-init model with a real tokenizer, or a Megatron checkpoint saved without one).
    tokenizer_path: Optional[str] = None
    # Use data.tokenizer=char|bpe (or a data.tokenizer_path with another vocabulary) although
    # model.path holds its own tokenizer, and a small tokenizer with a large pretrained
    # vocabulary; refused otherwise, since the checkpoint's embedding rows mean its own tokens.
    force_tokenizer: bool = False
    # Vocabulary size of the BPE tokenizer trained on the dataset (data.tokenizer=bpe).
    bpe_vocab_size: int = 4096
    # Longest prompt in tokens; longer dataset rows are skipped.
    max_prompt_tokens: int = 48
    # Shuffle the prompt order each pass (seeded by trainer.seed).
    shuffle: bool = True
    # Held-out JSONL in data.name's format (same keys, template and reward): the eval set named
    # "data" (eval.datasets) that trainer.eval_interval and python -m megatron_rl.eval score.
    # Synthetic tasks need none: they draw eval.limit fresh prompts from another seed (arithmetic:
    # from its held-out split, which no training prompt is in).
    eval_path: Optional[str] = None


@dataclass
class EvalConfig:
    # The sets scored by trainer.eval_interval and python -m megatron_rl.eval: data (data.eval_path
    # in data.name's format, scored by the run's reward; a synthetic task draws fresh prompts) |
    # gsm8k (GSM8K test, gsm8k reward, qa template) | math500 (MATH-500, math reward, math template).
    datasets: List[str] = field(default_factory=lambda: ["data"])
    # Problems of each set: the first N (0: all; a synthetic task's data set needs N > 0).
    limit: int = 0
    # Responses per problem (the n of pass@k).
    samples: int = 1
    # pass@k reported besides pass@1 (null: eval.samples).
    k: Optional[int] = None
    # Sampling temperature of eval responses (null: rollout.temperature). Each eval request samples
    # from its own seeded stream, so scores do not depend on what else the engine ran.
    temperature: Optional[float] = None
    # Problems whose responses are generated at once.
    batch: int = 64
    # GSM8K test JSONL (null: shared/data/gsm8k/test.jsonl beside the repository).
    gsm8k_path: Optional[str] = None
    # MATH-500 JSONL (null: shared/data/math500/test.jsonl beside the repository).
    math500_path: Optional[str] = None


@dataclass
class RewardConfig:
    # The verifier that scores a response: reverse_digits | sort_digits | gsm8k (the number after
    # '####') | math (math-verify equivalence of the last \boxed{} answer) | code (the program
    # passes the target's JSON test cases in the sandbox); a name registered in REWARDS.
    name: str = "reverse_digits"
    # A reward of your own by import path, package.module:function, used instead of reward.name:
    # called as fn(completion, target) (plain or async def) in a worker process, returning a number
    # (float, int, bool, numpy or torch scalar) or a dict with one under 'reward'. None:
    # reward.name chooses.
    fn: Optional[str] = None
    # Seconds one completion's score may take. A group is scored in one call to a worker process,
    # which is hung when no completion finishes for this long: the worker is killed and replaced,
    # that completion scores reward.fallback (counted), the rest go on.
    timeout_s: float = 10.0
    # Worker processes scoring groups at once.
    workers: int = 1
    # The score of a completion whose reward raised, timed out, or returned a value that is not a
    # finite number within [min_value, max_value] and max_abs; each such case is counted in
    # reward/errors (reward/timeouts for a timeout).
    fallback: float = 0.0
    # Bounds a reward value must lie within (null: no bound); a value outside is an error.
    min_value: Optional[float] = None
    # Upper bound of a reward value (null: no bound).
    max_value: Optional[float] = None
    # Largest |reward| accepted; a value beyond it is an error scored reward.fallback, so one
    # absurd reward (1e300) cannot overflow the advantages and the loss (null: no bound).
    max_abs: Optional[float] = 1.0e6
    # DAPO's soft overlong penalty: the last overlong_buffer tokens before rollout.max_new_tokens
    # cost up to overlong_penalty (linearly); 0 disables.
    overlong_buffer: int = 0
    # Largest overlong penalty, reached at rollout.max_new_tokens (with overlong_buffer > 0).
    overlong_penalty: float = 1.0


@dataclass
class SandboxConfig:
    # Isolation of the programs that reward.name=code and tool-using agents (calculator_agent) run:
    # auto (the strongest this machine offers) | bubblewrap (private file system, no network) |
    # namespaces+rlimits | rlimits. The run's config.yaml records the mode in use.
    mode: str = "auto"
    # Run model-written programs in a weak mode (namespaces+rlimits: host files visible;
    # rlimits: host files and network reachable) instead of refusing to start. Install
    # bubblewrap instead where you can (apt-get install bubblewrap).
    allow_weak_isolation: bool = False
    # Outside bubblewrap, the Python programs run with when the trainer is root (they run as an
    # unprivileged user, who must be able to read it). None: this Python if that user can read it,
    # else a system python3.
    python: Optional[str] = None


@dataclass
class TrainerConfig:
    # Training steps (policy updates) of the run.
    total_steps: int = 100
    # Seed of every random stream (data order, sampling, initialisation).
    seed: int = 1234
    # Defaults to runs/<recipe>/<timestamp>.
    run_dir: Optional[str] = None
    # Name of the recipe the config came from (set by the launcher; names the default run_dir).
    recipe: str = "custom"
    # Write a checkpoint every this many steps; 0: only the final one.
    checkpoint_interval: int = 0
    # Checkpoints kept in run_dir/checkpoints; older ones are deleted.
    checkpoint_keep: int = 2
    # Continue from the newest loadable checkpoint in run_dir, if there is one (an unreadable newer
    # one is skipped with a warning). Give the same trainer.run_dir to pick a run up again; false
    # on a run directory that already holds a run is refused (nothing is overwritten).
    resume: bool = True
    # Write a checkpoint after the last step.
    save_final_checkpoint: bool = True
    # Also write each checkpoint's weights as a Hugging Face directory (checkpoints/step_N/hf). Under
    # LoRA that is the merged model, and the adapters go beside it as a PEFT directory (step_N/peft).
    export_hf: bool = False
    # Write a few decoded responses to samples.jsonl every this many steps.
    log_interval: int = 1
    # Score the eval sets (eval.datasets) every this many steps with the trainer's engine and
    # log eval/<set>/pass@1 (and pass@k) to metrics.jsonl and TensorBoard; 0: off.
    eval_interval: int = 0
    # Where each step's scalars go besides metrics.jsonl (always written), e.g.
    # [tensorboard,wandb]: tensorboard (the run's tb/), wandb (Weights & Biases: pip install
    # 'megatron_rl[wandb]'; WANDB_MODE=offline keeps it on disk), mlflow (pip install
    # 'megatron_rl[mlflow]'; MLFLOW_TRACKING_URI says where). The resolved config is the run's
    # W&B config and MLflow params; a resumed run continues the same W&B and MLflow run.
    loggers: List[str] = field(default_factory=lambda: ["tensorboard"])
    # The W&B project and the MLflow experiment the run is logged in.
    project: str = "megatron_rl"
    # The run's name in W&B and MLflow; None: <recipe>/<run directory's name>.
    run_name: Optional[str] = None
    # Seconds between NVML readings of the GPUs this process uses (per-step gpu/ metrics:
    # utilisation, memory, power, clocks); 0 turns GPU telemetry off. No GPU: no gpu/ metrics.
    gpu_telemetry_interval_s: float = 1.0
    # Show a progress bar on a terminal.
    progress: bool = True
    # CPU cores for compute (0: all). When rollouts overlap training on CPU (async, η > 0), the
    # learner and the engine each get half, so their compute threads do not fight over cores.
    cpu_threads: int = 0
    # torchrun world: how long any collective, weight sync or engine call may wait for another
    # rank before the run fails naming the call and the ranks (a dead or stuck rank never hangs
    # the job). Also how long learner ranks wait for the driver's next call.
    rank_timeout_s: float = 1800.0


@dataclass
class RootConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
