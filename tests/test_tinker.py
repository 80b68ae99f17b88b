"""`looprl serve-tinker`: the real server (uvicorn in a thread) on the tiny random model in
float32, driven by the official, pinned `tinker` SDK (0.38.0) over HTTP: each loss against
values computed here by hand, gradients, optimizer steps, saved and loaded state,
samplers and their logprobs against the trainer's, and the requests it refuses."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")  # the dev extra pins it; make test installs it
from tinker import types  # noqa: E402

from looprl.tinker.app import build_app  # noqa: E402
from looprl.tinker.service import Service  # noqa: E402

MODEL = "tiny-random"
RNG = np.random.default_rng(0)


@pytest.fixture(scope="module")
def service_client(tmp_path_factory) -> Iterator[tinker.ServiceClient]:
    import uvicorn

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    service = Service(tmp_path_factory.mktemp("store"), torch.float32, [MODEL])
    server = uvicorn.Server(
        uvicorn.Config(build_app(service), host="127.0.0.1", port=port, log_level="error")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    saved = {k: os.environ.get(k) for k in ("TINKER_API_KEY", "TINKER_TELEMETRY")}
    os.environ.update(TINKER_API_KEY="tml-local", TINKER_TELEMETRY="0")
    client = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}")
    yield client
    client.close("success").result(timeout=30)
    server.should_exit = True
    thread.join(timeout=10)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def training(service_client):
    return service_client.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()


@pytest.fixture(scope="module")
def tokens(training) -> list[int]:
    return training.get_tokenizer().encode("Tic-tac-toe: X takes the centre, O a corner.")


def datum(tokens: list[int], **inputs: list[float]) -> types.Datum:
    """The standard shift: input tokens[:-1] predict targets tokens[1:]."""
    fields = {"target_tokens": tokens[1:], **inputs}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=fields)


def base_client(service_client):
    return service_client.create_lora_training_client(base_model=MODEL, rank=4).result()


def logprobs_of(training, tokens: list[int]) -> np.ndarray:
    n = len(tokens) - 1
    out = training.forward([datum(tokens, weights=[0.0] * n)], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_numpy()


def test_logprobs_are_the_base_models_at_creation(training, tokens):
    """LoRA's B starts at zero: the trainer's logprobs are the plain model's, in float32."""
    from looprl.model.load import load_causal_lm

    model = load_causal_lm(MODEL, torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens[:-1]])).logits[0]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    assert np.allclose(logprobs_of(training, tokens), expected.numpy(), atol=1e-5)


def hand_losses(lp: np.ndarray, q: np.ndarray, adv: np.ndarray, mask: np.ndarray) -> dict:
    """Each loss of the Tinker docs written out in numpy: sums over positions."""
    ratio = np.exp(lp - q)
    seq_ratio = np.exp((lp - q)[mask != 0].mean())
    return {
        "importance_sampling": -(ratio * adv).sum(),
        "ppo": -np.minimum(ratio * adv, np.clip(ratio, 0.8, 1.2) * adv).sum(),
        "ppo_wide": -np.minimum(ratio * adv, np.clip(ratio, 0.5, 3.0) * adv).sum(),
        "cispo": -(np.clip(ratio, 0.8, 1.2) * lp * adv).sum(),
        "dro": -(lp * adv - 0.5 * 0.1 * (lp - q) ** 2).sum(),
        "gspo": -np.minimum(seq_ratio * adv, np.clip(seq_ratio, 0.8, 1.2) * adv).sum(),
    }


def test_each_loss_matches_its_formula(training, tokens):
    """Two datums; sampler logprobs q off the trainer's by up to ±0.5 so that clipping acts
    for some tokens; advantages of both signs. `loss:sum` adds the datums' sums."""
    other = tokens[: len(tokens) // 2 + 2]
    seqs = [tokens, other]
    lps = [logprobs_of(training, s) for s in seqs]
    qs = [lp + RNG.uniform(-0.5, 0.5, lp.shape).astype(np.float32) for lp in lps]
    advs = [RNG.normal(size=lp.shape).astype(np.float32) for lp in lps]
    masks = [np.r_[np.zeros(2), np.ones(len(lp) - 2)].astype(np.float32) for lp in lps]
    weights = [RNG.normal(size=lp.shape).astype(np.float32) for lp in lps]  # signed
    expected = {
        k: sum(hand_losses(*parts)[k] for parts in zip(lps, qs, advs, masks, strict=True))
        for k in hand_losses(lps[0], qs[0], advs[0], masks[0])
    }
    expected["cross_entropy"] = sum(-(lp * w).sum() for lp, w in zip(lps, weights, strict=True))
    cases = {
        "cross_entropy": ("cross_entropy", None),
        "importance_sampling": ("importance_sampling", None),
        "ppo": ("ppo", None),
        "ppo_wide": ("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 3.0}),
        "cispo": ("cispo", None),
        "dro": ("dro", {"beta": 0.1}),
        "gspo": ("gspo", None),
    }
    for key, (loss_fn, config) in cases.items():
        data = []
        for s, q, a, m, w in zip(seqs, qs, advs, masks, weights, strict=True):
            if loss_fn == "cross_entropy":
                data.append(datum(s, weights=w.tolist()))
                continue
            extra = {"sequence_ratio_mask": m.tolist()} if loss_fn == "gspo" else {}
            data.append(datum(s, logprobs=q.tolist(), advantages=a.tolist(), **extra))
        out = training.forward_backward(data, loss_fn, loss_fn_config=config).result()
        assert out.metrics["loss:sum"] == pytest.approx(expected[key], rel=1e-4, abs=1e-4), key
        for lp, row in zip(lps, out.loss_fn_outputs, strict=True):
            assert np.allclose(row["logprobs"].to_numpy(), lp, atol=1e-5)
    assert expected["ppo"] != pytest.approx(expected["ppo_wide"])  # the clip acted
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()  # gradients cleared


def test_importance_sampling_on_policy_has_the_gradient_of_weighted_cross_entropy(
    service_client, tokens
):
    """With q = the trainer's own logprobs the ratio is 1 and its gradient is logp's, so
    one step of each from the same start lands on the same weights (and they moved)."""
    adv = RNG.normal(size=len(tokens) - 1).astype(np.float32).tolist()
    after = []
    for loss_fn in ("importance_sampling", "cross_entropy"):
        client = service_client.create_lora_training_client(
            base_model=MODEL, rank=4, seed=1
        ).result()
        lp = logprobs_of(client, tokens)
        inputs = {"weights": adv} if loss_fn == "cross_entropy" else {}
        if loss_fn == "importance_sampling":
            inputs = {"logprobs": lp.tolist(), "advantages": adv}
        client.forward_backward([datum(tokens, **inputs)], loss_fn).result()
        adam = types.AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)
        client.optim_step(adam).result()
        after.append(logprobs_of(client, tokens))
    assert np.allclose(after[0], after[1], atol=1e-5)
    assert not np.allclose(after[0], lp, atol=1e-4)


def test_save_and_load_state_restore_the_weights(service_client, training, tokens):
    n = len(tokens) - 1
    before = logprobs_of(training, tokens)
    path = training.save_state("before").result().path
    assert path.endswith("/weights/before") and path.startswith("tinker://")
    training.forward_backward([datum(tokens, weights=[1.0] * n)], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert not np.allclose(logprobs_of(training, tokens), before, atol=1e-4)
    training.load_state(path).result()
    assert np.array_equal(logprobs_of(training, tokens), before)
    training.load_state_with_optimizer(path).result()
    assert np.array_equal(logprobs_of(training, tokens), before)
    restored = service_client.create_training_client_from_state_with_optimizer(path).result()
    assert np.array_equal(logprobs_of(restored, tokens), before)


def test_sampler_logprobs_are_the_trainers_and_a_fixed_snapshot(training, tokens):
    n = len(tokens) - 1
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokens[:6])
    params = types.SamplingParams(max_tokens=6, seed=3, temperature=1.0, stop=[])
    result = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
    assert len(result.sequences) == 2
    assert result.sequences[0].tokens != result.sequences[1].tokens  # two streams
    trainer_rows = []
    for seq in result.sequences:
        assert seq.stop_reason == "length" and len(seq.tokens) == 6
        full = tokens[:6] + list(seq.tokens)
        trainer = logprobs_of(training, full)[5:]  # the sampled positions
        assert np.allclose(seq.logprobs, trainer, atol=1e-4)
        trainer_rows.append(trainer)
    # prompt logprobs: None at position 0, then the trainer's
    prompt_lp = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert prompt_lp[0] is None
    assert np.allclose(prompt_lp[1:], logprobs_of(training, tokens), atol=1e-4)
    # the trainer steps on; the sampler keeps the weights it was made from
    training.forward_backward([datum(tokens, weights=[1.0] * n)], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    # and requests sent at once, sampled as one batch, draw the same samples
    futures = [sampler.sample(prompt, num_samples=2, sampling_params=params) for _ in range(3)]
    for again in [f.result() for f in futures]:
        assert [s.tokens for s in again.sequences] == [s.tokens for s in result.sequences]
        assert np.allclose(again.sequences[1].logprobs, trainer_rows[1], atol=1e-4)
    assert not np.allclose(logprobs_of(training, tokens)[1:], prompt_lp[2:], atol=1e-4)


def test_unseeded_requests_sampled_as_one_batch_draw_their_own_samples(tmp_path, tokens):
    """A recipe asks for a group's samples as one-sample requests without a seed; sampled
    as one batch, each draws from its own stream, not a copy of the first's."""
    from tinker.proto import tinker_public_pb2

    from looprl.tinker.sampling import sample_batch

    sampler = Service(tmp_path, torch.float32, [MODEL]).new_sampler("group", MODEL, None)
    body = {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens[:6]}]},
        "num_samples": 1,
        "sampling_params": {"max_tokens": 8, "temperature": 1.0, "stop": []},
    }
    drawn = set()
    for answer in sample_batch(sampler, [body] * 4):
        sequence = tinker_public_pb2.SampleResponse.FromString(answer).sequences[0]
        drawn.add(np.frombuffer(sequence.tokens, dtype=np.int32).tobytes())
    assert len(drawn) == 4


def test_named_sampler_weights_top_k_and_stop_tokens(service_client, training, tokens):
    path = training.save_weights_for_sampler("named").result().path
    assert path.endswith("/sampler_weights/named")
    sampler = service_client.create_sampling_client(model_path=path).result()
    prompt = types.ModelInput.from_ints(tokens[:8])
    out = sampler.sample(
        prompt,
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=3, temperature=0.0),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
    ).result()
    top = out.topk_prompt_logprobs
    assert top[0] is None and len(top) == 8
    for position, row in enumerate(top[1:], start=1):
        assert len(row) == 3 and row[0][1] >= row[1][1] >= row[2][1]
        assert row[0][1] >= out.prompt_logprobs[position] - 1e-5
    first = out.sequences[0].tokens[0]  # greedy: the stop id is the first token it picks
    stopped = sampler.sample(
        prompt, 1, types.SamplingParams(max_tokens=5, temperature=0.0, stop=[first])
    ).result()
    assert list(stopped.sequences[0].tokens) == [first]
    assert stopped.sequences[0].stop_reason == "stop"
    base = service_client.create_sampling_client(base_model=MODEL).result()
    assert len(base.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result().sequences) == 1


def refused(future) -> str:
    with pytest.raises(tinker.RequestFailedError) as caught:
        future.result(timeout=60)
    return str(caught.value)


def test_refusals_are_one_clear_error(service_client, training, tokens):
    n = len(tokens) - 1
    short = datum(tokens, weights=[1.0] * (n - 1))
    assert "shape [" in refused(training.forward_backward([short], "cross_entropy"))
    message = refused(
        training.forward_backward([datum(tokens, weights=[1.0] * n)], "stable_reinforce")
    )
    assert "not published" in message
    policy = {"logprobs": [0.0] * n, "advantages": [1.0] * n}
    assert "beta" in refused(training.forward_backward([datum(tokens, **policy)], "dro"))
    assert "sequence_ratio_mask" in refused(
        training.forward_backward([datum(tokens, **policy)], "gspo")
    )
    image = types.Datum(
        model_input=types.ModelInput(
            chunks=[types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4)]
        ),
        loss_fn_inputs={"target_tokens": [1] * 4, "weights": [1.0] * 4},
    )
    assert "text models only" in refused(training.forward_backward([image], "cross_entropy"))
    huge = datum([*tokens[:-1], 10**6], weights=[1.0] * n)
    assert "outside this model's vocabulary" in refused(
        training.forward_backward([huge], "cross_entropy")
    )
    # the queue went on past the refused requests
    assert len(logprobs_of(training, tokens)) == n
    with pytest.raises(tinker.RequestFailedError, match="unknown model 'no-such-model'"):
        service_client.create_lora_training_client(base_model="no-such-model", rank=4).result(
            timeout=60
        )


def test_a_result_slower_than_a_poll_comes_on_a_later_poll(training, tokens, monkeypatch):
    """A poll that waits longer than its limit answers try_again; the work goes on and the
    SDK's next poll gets the result."""
    import looprl.tinker.app

    monkeypatch.setattr(looprl.tinker.app, "POLL_WAIT_S", 0.001)
    assert len(logprobs_of(training, tokens)) == len(tokens) - 1


def test_a_run_folder_trains_on_from_its_trained_model(service_client, tmp_path, tokens):
    """base_model = a looprl run folder: its newest checkpoint's model, LoRA merged."""
    from looprl.config import load_config
    from looprl.loop.checkpoint import save_weights
    from looprl.loop.policy import load_policy

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model:\n  name: tiny-random\n")
    policy = load_policy(load_config(run / "config.yaml", ["model.device=cpu"]))
    with torch.no_grad():  # a trained adapter: B away from its zero start
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    save_weights(run / "checkpoints" / "step_000001", policy.model, {"step": 1}, sharded=False)
    with torch.no_grad():
        logits = policy.model(input_ids=torch.tensor([tokens[:-1]])).logits[0]
    trained = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    client = service_client.create_lora_training_client(base_model=str(run), rank=4).result()
    served = logprobs_of(client, tokens)
    assert np.allclose(served, trained.numpy(), atol=1e-4)
    assert not np.allclose(served, logprobs_of(base_client(service_client), tokens), atol=1e-3)
    text = "Tic-tac-toe: X takes the centre, O a corner."
    assert client.get_tokenizer().encode(text) == tokens  # the exported folder's tokenizer


def test_a_models_requests_run_in_seq_id_order(tmp_path, monkeypatch):
    """Requests of one model run in seq_id order whatever order they arrive in; one that
    never comes holds the queue only GAP_TIMEOUT_S."""
    import looprl.tinker.service

    monkeypatch.setattr(looprl.tinker.service, "GAP_TIMEOUT_S", 0.3)
    service = Service(tmp_path, torch.float32, [MODEL])
    ran: list[int] = []

    def job(seq: int):
        return lambda: ran.append(seq) or {}

    ids = [service.submit(job(seq), "m", seq) for seq in (3, 1, 2, 5)]
    for request_id in ids[:3]:
        assert service.results[request_id].result(timeout=5).error is None
    assert ran == [1, 2, 3]
    time.sleep(0.05)
    assert ran == [1, 2, 3]  # 5 waits for 4
    assert service.results[ids[3]].result(timeout=5).error is None
    assert ran == [1, 2, 3, 5]
