"""The architecture matrix: each tiny model of `looprl.model.tiny` samples through the `hf`
engine exactly as a plain full forward would, the trainer scores the engine's tokens
within LOGPROB_BOUND, LoRA adapts the right weights, the export merges them losslessly,
and a `looprl run` step runs end to end on the exotic ones (bailing_hybrid, MoEs, gemma3,
phi3's fused projections, deepseek_v3's MLA, whose KV a session also keeps across turns)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

from looprl.config import LoraConfig as LoraSettings
from looprl.engine import GenerationRequest, SamplingParams
from looprl.engine.hf import HFEngine
from looprl.envs.builtin.tictactoe import TicTacToeMove
from looprl.forward.prefix import shared_prefill
from looprl.forward.score import sequence_logprobs
from looprl.loop.policy import add_lora
from looprl.model.arch import MATRIX, fast_paths, router_modules
from looprl.model.tiny import TINY_ARCHITECTURES, build_tiny, perturb_adapters, save_tiny

ARCHS = list(TINY_ARCHITECTURES)
MOE = {"qwen3_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v3", "bailing_hybrid"}
PLAIN_CACHE = set(ARCHS) - {"gemma3", "bailing_hybrid"}  # keys and values (MLA: its latent)
# MLA: the cache holds a latent that attention expands, so no cascade level can hold it
NO_CASCADE = {"deepseek_v3"}
# engine vs trainer vs full forward, float32 on the CPU: the same sums in another order
LOGPROB_BOUND = 1e-4
DENSE_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
# the attention's projections LoRA must adapt, where they are not Llama's q_proj and o_proj
ATTENTION_TARGETS = {
    "phi3": {"qkv_proj", "o_proj"},
    "deepseek_v3": {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"},
}
# a dense model's projections, where they are not Llama's (fused q/k/v and gate/up)
FUSED_TARGETS = {"phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}}


@pytest.fixture(scope="module")
def models(tokenizer):
    """One tiny model per architecture, built on first use and shared by the tests."""
    built: dict[str, torch.nn.Module] = {}

    def get(arch: str) -> torch.nn.Module:
        if arch not in built:
            built[arch] = build_tiny(arch, tokenizer)
        return built[arch]

    return get


@pytest.fixture(scope="module")
def requests(renderer):
    """Tic-tac-toe prompts (a long shared head, distinct tails), each twice, with token
    limits that make rows finish at different times."""
    env = TicTacToeMove(tool_choice="auto")
    out = []
    for n, task in enumerate(env.tasks("train", n=3, seed=11)):
        obs = env.reset(task)
        prompt = renderer.prompt_ids(obs.messages, obs.tools)
        out += [GenerationRequest(prompt, max_new_tokens=5 + 6 * ((n + g) % 3)) for g in range(2)]
    return out


def full_forward_logprobs(model, prompt, completion) -> torch.Tensor:
    """logprobs [len(completion), V] from one forward of the whole sequence, no cache."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], -1)


def replayed(engine, request, params, index, logp_TV) -> list[int]:
    """The tokens the engine's sampler draws for request `index` (its own random stream)
    from the full forward's distributions: the plain path's tokens, for as long as they
    agree with the engine's (the test then stops at the first difference)."""
    row = engine._row(index, request, params, params.seed)
    for logp_V in logp_TV:
        token, _ = engine._sample(logp_V[None], params, [row])
        row.ids.append(int(token[0]))
    return row.ids


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_tokens_equal_the_plain_forward(arch, models, tokenizer, renderer, requests):
    model = models(arch)
    engine = HFEngine(model, tokenizer, renderer.eos_ids, batch_size=4)  # rows leave and join
    expected_plain = arch in PLAIN_CACHE
    assert engine.paths.kv_buffers is expected_plain
    assert engine.paths.shared_head is expected_plain
    assert engine.cascade is (expected_plain and arch not in NO_CASCADE)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=5)
    outs = engine.generate(requests, params)
    for index, (request, out) in enumerate(zip(requests, outs)):
        logp_TV = full_forward_logprobs(model, request.prompt_ids, out.ids)
        assert out.ids == replayed(engine, request, params, index, logp_TV)
        want = logp_TV.gather(1, torch.tensor(out.ids)[:, None])[:, 0]
        gap = (want - torch.tensor(out.logprobs)).abs().max().item()
        assert gap < LOGPROB_BOUND, (arch, gap)


def test_an_mla_models_kv_is_kept_across_turns(models, tokenizer, renderer, requests):
    """deepseek_v3 caches a latent and a rotary key of other widths than keys and values:
    a session keeps them per episode and merges them into the next turn's batch, whose
    tokens and logprobs are a plain forward's."""
    model = models("deepseek_v3")
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=4)
    engine = HFEngine(model, tokenizer, renderer.eos_ids, batch_size=4)
    kept = [GenerationRequest(r.prompt_ids, keep_kv=True) for r in requests]
    with engine.session():
        first = engine.generate(kept, params)
        second = [
            GenerationRequest(r.prompt_ids + o.ids + [198, 2683, 359])  # a tool result
            for r, o in zip(kept, first)
        ]
        fed: list[int] = []
        hook = model.register_forward_hook(
            lambda m, a, kw, out: fed.append(kw["input_ids"].numel()), with_kwargs=True
        )
        try:
            again = engine.generate(second, params)
        finally:
            hook.remove()
    assert sum(fed) < len(requests[0].prompt_ids)  # the prompts' KV came from the first turn
    for index, (request, out) in enumerate(zip(second, again)):
        logp_TV = full_forward_logprobs(model, request.prompt_ids, out.ids)
        assert out.ids == replayed(engine, request, params, index, logp_TV)
        want = logp_TV.gather(1, torch.tensor(out.ids)[:, None])[:, 0]
        assert (want - torch.tensor(out.logprobs)).abs().max().item() < LOGPROB_BOUND


def test_a_shared_head_would_shift_gemma3s_sliding_window(models, requests):
    """Why gemma3 prefills without the shared head: the masked gap between head and tail
    counts against the window (transformers counts it in cache columns), and the tails'
    next-token logits drift from a plain forward's."""
    model = models("gemma3")
    prompts = [r.prompt_ids for r in requests[::2]]
    want = torch.stack([full_forward_logprobs(model, p, [0])[0] for p in prompts])

    def drift(share_head: bool) -> float:
        with torch.no_grad():
            part = shared_prefill(model, prompts, 0, torch.device("cpu"), share_head=share_head)
        got = torch.log_softmax(part.logits_CV.float(), -1)
        return (got - want).abs().max().item()

    assert drift(share_head=False) < LOGPROB_BOUND
    assert drift(share_head=True) > 10 * LOGPROB_BOUND


def lora_model(arch, tokenizer):
    """The tiny model with LoRA as `load_policy` adds it, B matrices non-zero."""
    return perturb_adapters(add_lora(build_tiny(arch, tokenizer), LoraSettings(rank=4, alpha=8.0)))


def adapted(model) -> set[str]:
    """Names (inside a decoder layer) of the modules that got LoRA adapters."""
    return {
        name.split(".lora_A")[0].split(".layers.")[-1].split(".", 1)[1]
        for name, _ in model.named_parameters()
        if ".lora_A." in name
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_targets_and_trainer_logprobs(arch, tokenizer, renderer, requests):
    """LoRA adapts attention + MLP projections (MoE: attention + the fused expert weights,
    routers frozen); the trainer's logprobs of the engine's tokens agree with the engine's
    within LOGPROB_BOUND, and every adapter gets a gradient."""
    model = lora_model(arch, tokenizer)
    names = adapted(model)
    leaves = {name.rsplit(".", 1)[-1] for name in names}
    assert ATTENTION_TARGETS.get(arch, {"q_proj", "o_proj"}) <= leaves
    routers = {name.split(".layers.")[-1].split(".", 1)[1] for name in router_modules(model)}
    if arch in MOE:
        assert "mlp.experts" in names  # the fused expert weights (PEFT target_parameters)
        assert not names & routers, names & routers
    else:
        assert leaves >= FUSED_TARGETS.get(arch, DENSE_TARGETS)
        assert not routers
    engine = HFEngine(model, tokenizer, renderer.eos_ids)
    chosen = requests[:4]
    outs = engine.generate(chosen, SamplingParams(temperature=1.0, max_new_tokens=10, seed=2))
    sequences = [r.prompt_ids + o.ids for r, o in zip(chosen, outs)]
    masks = [[0] * len(r.prompt_ids) + [1] * len(o.ids) for r, o in zip(chosen, outs)]
    model.train()
    logp_BS, mask_BS = sequence_logprobs(model, sequences, masks, 0, torch.device("cpu"), 1.0)
    engine_logprobs = torch.tensor([lp for o in outs for lp in o.logprobs])
    gap = (logp_BS[mask_BS].detach() - engine_logprobs).abs().max().item()
    assert gap < LOGPROB_BOUND, (arch, gap)
    (logp_BS * mask_BS).sum().backward()
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_lora_dropout_on_expert_weights_is_refused_clearly(models):
    from looprl.errors import ConfigError

    with pytest.raises(ConfigError, match="model.lora.dropout=0"):
        add_lora(copy.deepcopy(models("mixtral")), LoraSettings(dropout=0.1))


@pytest.mark.parametrize("arch", ARCHS)
def test_export_merges_lora_losslessly(arch, tokenizer, tmp_path):
    """merge_and_unload + save_pretrained + from_pretrained (the export path) gives the
    adapted model's logits, and a plain transformers model without adapters."""
    from transformers import AutoModelForCausalLM

    model = lora_model(arch, tokenizer).eval()
    ids = torch.tensor([[1, 5, 9, 200, 3000, 7, 42, 11]])
    with torch.no_grad():
        want = model(ids).logits
    model.merge_and_unload().save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert not any("lora" in name for name, _ in loaded.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, want, rtol=1e-4, atol=1e-4)


def test_a_loaded_model_never_swaps_in_hub_kernels(tokenizer, tmp_path):
    """A model loaded from a folder (or the hub) is not kernelized: with `kernels`
    installed, transformers would otherwise fetch hub kernels on each train/eval switch
    on a GPU (an offline GPU machine failed right there) and run other layers in the
    engine than in the trainer."""
    from looprl.model.load import load_causal_lm

    save_tiny("llama", tmp_path / "tiny")
    model = load_causal_lm(str(tmp_path / "tiny"), torch.float32)
    model.train()
    model.eval()
    assert model.use_kernels is False and model.kernels_mode is None


def test_fast_paths_per_architecture(tokenizer):
    """Every tiny architecture is in the matrix; one outside it gets the generic path and
    a one-line notice saying so."""
    from transformers import GPT2Config

    from looprl.model.tiny import tiny_config

    assert set(MATRIX) >= {tiny_config(arch, tokenizer).model_type for arch in ARCHS}
    assert fast_paths(tiny_config("llama", tokenizer)).notice() is None
    hybrid = fast_paths(tiny_config("bailing_hybrid", tokenizer))
    assert not hybrid.trainer_prefix and "recurrent state" in hybrid.notice()
    mla = fast_paths(tiny_config("deepseek_v3", tokenizer))
    assert mla.kv_buffers and mla.shared_head and mla.trainer_prefix and not mla.cascade
    assert "MLA caches a compressed latent" in mla.notice()
    other = fast_paths(GPT2Config())
    assert not (other.kv_buffers or other.shared_head or other.cascade or other.trainer_prefix)
    assert "gpt2 is not in the tested matrix" in other.notice()
    assert "\n" not in other.notice()


# ---- `looprl run`, one step, on the exotic architectures


@pytest.fixture(scope="module")
def runner():
    return CliRunner(env={"COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"})


ONE_STEP = [
    "--set", "train.steps=1", "--set", "rollout.tasks_per_step=1",
    "--set", "rollout.group_size=4", "--set", "rollout.max_new_tokens=32",
    "--set", "eval.tasks=1", "--set", "eval.samples_per_task=1",
    "--set", "logging.trackers=[]", "--set", "train.checkpoint_every=1",
    "--set", "seed=3",
]  # fmt: skip


RUN_ARCHS = ["bailing_hybrid", "qwen3_moe", "gemma3", "phi3", "glm4_moe", "deepseek_v3"]


@pytest.mark.parametrize("arch", RUN_ARCHS)
def test_one_run_step_end_to_end(arch, runner, tmp_path):
    from looprl.cli import app

    folder = save_tiny(arch, tmp_path / arch)
    run = tmp_path / "run"
    res = runner.invoke(app, ["run", "--out", str(run), "--set", f"model.name={folder}", *ONE_STEP])
    assert res.exit_code == 0, res.output[-3000:]
    notice = "fast paths off for this model" in res.output
    assert notice is (arch not in PLAIN_CACHE or arch in NO_CASCADE)
    (row,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert abs(row["rollout/logprob_gap"]) < LOGPROB_BOUND
    router_keys = [key for key in row if key.startswith("train/router_")]
    if arch in MOE:
        assert 0 <= row["train/router_load_balance"] < 8**0.5  # sqrt(E - 1) = all on one
        shares = [row[key] for key in router_keys if key.startswith("train/router_share/")]
        assert len(shares) == 8 and abs(sum(shares) - 1) < 1e-9
    else:
        assert not router_keys
    if arch == "bailing_hybrid":  # the export round trip of the run's trained adapters
        exported = tmp_path / "exported"
        res = runner.invoke(app, ["export", str(run), "--out", str(exported)])
        assert res.exit_code == 0, res.output[-3000:]
        assert_export_matches_the_run(run, exported)


def assert_export_matches_the_run(run, exported) -> None:
    from transformers import AutoModelForCausalLM

    from looprl.config import load_config
    from looprl.loop.checkpoint import list_checkpoints, load_weights
    from looprl.loop.policy import load_policy

    policy = load_policy(load_config(run / "config.yaml"))
    load_weights(policy.model, list_checkpoints(run)[-1])
    merged = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 200, 3000, 7, 42, 11]])
    with torch.no_grad():
        want = policy.model.eval()(ids).logits
        torch.testing.assert_close(merged(ids).logits, want, rtol=1e-4, atol=1e-4)


# ---- models that cannot run fail before anything is written


def test_a_model_without_a_causal_lm_head_fails_first(tokenizer, tmp_path):
    from transformers import DistilBertConfig

    from looprl.cli import app

    folder = tmp_path / "encoder"
    DistilBertConfig(vocab_size=len(tokenizer)).save_pretrained(folder)  # no weights needed
    tokenizer.save_pretrained(folder)
    run = tmp_path / "run"
    res = CliRunner().invoke(app, ["run", "--out", str(run), "--set", f"model.name={folder}"])
    assert res.exit_code == 2, res.output
    assert "'DistilBert' model without a causal language-model head" in res.output
    assert not run.exists()


def test_a_base_model_without_a_chat_template_names_the_field(tokenizer, tmp_path):
    from looprl.chat import ChatRenderer
    from looprl.cli import app
    from looprl.errors import ModelError
    from looprl.model.load import load_tokenizer

    folder = save_tiny("qwen3", tmp_path / "base")
    (folder / "chat_template.jinja").unlink()  # a base model ships no template
    run = tmp_path / "run"
    res = CliRunner().invoke(app, ["run", "--out", str(run), "--set", f"model.name={folder}"])
    assert res.exit_code == 2, res.output
    assert "has no chat template" in res.output and "model.chat_template" in res.output
    assert not run.exists()
    template = tmp_path / "template.jinja"
    template.write_text(tokenizer.chat_template)
    for value in (str(template), tokenizer.chat_template):
        named = load_tokenizer(str(folder), chat_template=value)
        assert named.chat_template == tokenizer.chat_template
        assert ChatRenderer(named).eos_ids == ChatRenderer(tokenizer).eos_ids
    with pytest.raises(ModelError, match="neither a Jinja template"):
        load_tokenizer(str(folder), chat_template=str(tmp_path / "missing.jinja"))
