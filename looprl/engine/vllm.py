"""The `vllm` rollout engine: the engine contract on a vLLM server (engine/vllm_server.py).

Token ids in, sampled ids and logprobs out, over `/v1/completions` (a token-id prompt,
`return_token_ids`, the sampled token's logprob). Every request is one HTTP call on its
own thread, so the server batches them as it pleases (continuous batching); an episode's
next turn finds its earlier turns' KV by vLLM's prefix caching, so there are no sessions.

Seeds: request i samples with its own seed, derived from `params.seed` and its stream
(its index, or `GenerationRequest.stream`) as the `hf` engine derives its stream keys, so
a seeded batch samples the same whatever runs alongside it. The two engines' random
streams differ, so a seed gives each engine its own (reproducible) samples.

Forced calls: the constraint becomes the very grammar the `hf` engine compiles with
xgrammar (engine/grammar.py), sent as EBNF text to vLLM's xgrammar backend. vLLM masks
the logits before its sampler, so the logprobs it reports for a constrained request are
those of the masked distribution; the contract wants the unconstrained ones, so each
constrained completion is rescored: one more call with the completion appended to the
prompt and `prompt_logprobs` (a prefill, no decoding), at temperature 1 (what greedy and
T = 1 sampling are scored at; at other temperatures a forced call is an error). Or, with
a `rescore` function (`rollout.vllm_rescore=policy`, the default in a run), the policy
module in looprl's process scores all of a batch's constrained completions in one
batched pass at the sampling temperature: the trainer's own logprobs, so those tokens
show no engine/trainer gap, and on a CPU far cheaper than vLLM's prompt logprobs, which
compute the whole vocabulary at every prompt position, one request at a time. Which
tokens the grammar forced is not recorded (`Completion.free` is None): where
`loss_on: free` needs it, loop/decisions.py replays the grammar over the completion.
Unconstrained logprobs come from the sampler after temperature (the server's
`processed_logprobs` mode); with top_k/top_p they are those of the truncated
distribution, where the `hf` engine reports the untruncated one.

Weights: before each `generate`, the engine looks whether the policy's trainable
weights changed since the last push (in-place updates bump a tensor's version), and
pushes them: a LoRA adapter is written to a folder and reloaded in place under the same
name; full fine-tuning writes the weights to one safetensors file that every worker
loads (`vllm_worker/looprl_vllm_worker.py`). Either file is written one tensor at a
time, each made whole in turn and freed before the next (engine/weight_push.py). The
prefix cache, whose KV came from the old weights, is then reset. Nothing is reloaded
from scratch.

A sharded policy (train.shard=fsdp: FSDP2 DTensors) is pushed only by `load_weights`,
which every rank calls together at a rollout phase's start (loop/shard.py
`rollout_weights`): each tensor is gathered from every rank in turn, a collective, so
`generate`, which a rank may call any number of times, never pushes one.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from torch.distributed.tensor import DTensor

from looprl.algo.logprobs import scoring_temperature
from looprl.engine import Completion, Constraint, GenerationRequest, SamplingParams
from looprl.engine.vllm_server import SERVED_NAME, LaunchSpec, VLLMServer
from looprl.engine.weight_push import PushStats, save_adapter_in_turn, save_in_turn
from looprl.errors import EngineError, ModelError
from looprl.model.load import base_model
from looprl.seeds import stream_seed

# (prompts, completions, temperature) -> each completion's logprobs, by the policy module
Rescorer = Callable[[list[list[int]], list[list[int]], float], list[list[float]]]
ADAPTER_NAME = "looprl-lora"
MAX_THREADS = 256  # requests in flight at once; the server queues the rest itself


class VLLMEngine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        stop_token_ids: list[int],
        server: VLLMServer,
        workdir: Path,
        rescore: Rescorer | None = None,
        adapter: str = ADAPTER_NAME,
    ) -> None:
        self.policy_model = model
        self.adapter = adapter  # the LoRA adapter's name on the server
        self.owns_server = True  # close() stops it
        self.rescore = rescore
        self.tokenizer = tokenizer
        self.stop_token_ids = list(stop_token_ids)
        self.server = server
        self.workdir = workdir
        self.lora = hasattr(model, "peft_config")
        self.served = adapter if self.lora else SERVED_NAME
        self._grammars: dict[str, str] = {}
        self._versions: dict[str, int] | None = None
        self.pushes = 0  # weight pushes so far (a test reads it)
        self.push_stats = PushStats()  # what the last push gathered (a test reads it)
        self.sharded = False  # the policy's weights are DTensors: `load_weights` pushes
        # whether a rollout phase needs the policy module's whole weights in this process
        # (loop/shard.py): only to rescore forced calls with it
        self.reads_policy = rescore is not None

    # ------------------------------------------------------------------ start and stop

    @classmethod
    def launch(
        cls,
        model: Any,
        tokenizer: Any,
        stop_token_ids: list[int],
        spec: LaunchSpec | None,
        url: str | None = None,
        rescore: Rescorer | None = None,
    ) -> VLLMEngine:
        """Save the policy's base model to a temporary folder and start a server on it
        (or attach to `url`), then check that it serves one token."""
        workdir = Path(tempfile.mkdtemp(prefix="looprl-vllm-"))
        try:
            if url is not None:
                server = VLLMServer(url)
                server.wait_ready(30.0)
            else:
                assert spec is not None
                spec.model_dir = workdir / "model"
                save_base_model(model, tokenizer, spec.model_dir)
                server = VLLMServer.start(spec, workdir)
            engine = cls(model, tokenizer, stop_token_ids, server, workdir, rescore)
            engine.check_serves()
        except BaseException:
            if "server" in locals():
                server.close()
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        return engine

    def check_serves(self) -> None:
        """One token, before any rollout: a model vLLM cannot run fails here."""
        self._push(force=True)
        try:
            self.generate(
                [GenerationRequest([self.tokenizer.bos_token_id or 0, 1])],
                SamplingParams(max_new_tokens=1, seed=0),
            )
        except EngineError as err:
            raise ModelError(f"vLLM cannot run this model:\n{err}") from None

    def replica(self, model: Any, rescore: Rescorer | None = None) -> VLLMEngine:
        """An engine on this engine's server sampling from `model` (a copy of the policy
        with other weights: loop/overlap.py) under an adapter of its own, so that the two
        never sample each other's weights. LoRA only: full fine-tuning has one set of
        weights on the server."""
        if not self.lora:
            raise EngineError(
                "a second set of weights on one vLLM server needs LoRA adapters; with full "
                "fine-tuning there is one (model.lora.enabled=true, or rollout.max_staleness=0)"
            )
        workdir = Path(tempfile.mkdtemp(prefix="looprl-vllm-replica-"))
        engine = VLLMEngine(
            model,
            self.tokenizer,
            self.stop_token_ids,
            self.server,
            workdir,
            rescore,
            adapter=f"{self.adapter}-replica",
        )
        engine.owns_server = False
        engine.check_serves()
        return engine

    def close(self) -> None:
        if self.owns_server:
            self.server.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    @property
    def device(self) -> str:
        return f"vLLM at {self.server.url}"

    # ------------------------------------------------------------------ weights

    def load_weights(self, state_dict: dict[str, Any] | None = None) -> None:
        """Push the policy's current weights to the server now. With a sharded policy
        every rank calls it, together (module doc)."""
        self._push(force=True)

    def _trainable(self) -> dict[str, Any]:
        params = self.policy_model.named_parameters()
        if self.lora:
            return {name: p for name, p in params if "lora_" in name}
        return dict(base_model(self.policy_model).named_parameters())

    def _push(self, force: bool = False) -> None:
        """Send the trainable weights if any changed since the last push (or `force`)."""
        params = self._trainable()
        self.sharded = self.sharded or any(isinstance(p, DTensor) for p in params.values())
        versions = {name: p._version for name, p in params.items()}
        if self._versions is not None and versions == self._versions and not force:
            return
        if self.lora:
            folder = self.workdir / "adapter"
            save_adapter_in_turn(self.policy_model, folder, self.push_stats)
            body = {"lora_name": self.adapter, "lora_path": str(folder), "load_inplace": True}
            self.server.post("/v1/load_lora_adapter", body)
        else:
            # every weight, not only the changed ones: vLLM reloads whole layers (and
            # after a full-fine-tuning step every weight has changed anyway)
            path = self.workdir / "weights.safetensors"
            save_in_turn(path, params.items(), self.push_stats)
            self.server.post(
                "/collective_rpc", {"method": "looprl_load_weights", "args": [str(path)]}
            )
            path.unlink()
        self.server.post("/reset_prefix_cache", {})
        self._versions = versions
        self.pushes += 1

    # ------------------------------------------------------------------ sampling

    def generate(
        self, requests: list[GenerationRequest], params: SamplingParams
    ) -> list[Completion]:
        """One completion per request, each its own HTTP call (see the module doc)."""
        if not requests:
            return []
        if not self.sharded:  # a sharded policy is pushed by `load_weights`, every rank
            self._push()
        base_seed = (
            params.seed if params.seed is not None else random.SystemRandom().getrandbits(62)
        )
        temperature = scoring_temperature(params.temperature)
        local = [
            i
            for i, r in enumerate(requests)
            if r.constraint is not None and self.rescore is not None and not r.top_logprobs
        ]
        remote = [i for i, r in enumerate(requests) if r.constraint is not None and i not in local]
        if remote and temperature != 1.0:
            raise EngineError(
                f"the vllm engine scores forced calls at temperature 1, not "
                f"{params.temperature}; use temperature 0 or 1, rollout.vllm_rescore=policy, "
                "or rollout.engine=hf"
            )

        def sample(index: int) -> Completion:
            request = requests[index]
            stream = index if request.stream is None else request.stream
            seed = stream_seed(base_seed, stream)
            return self._sample(request, params, seed)

        with ThreadPoolExecutor(max_workers=min(len(requests), MAX_THREADS)) as pool:
            completions = list(pool.map(sample, range(len(requests))))
        if local:
            scored = self.rescore(
                [list(requests[i].prompt_ids) for i in local],
                [completions[i].ids for i in local],
                temperature,
            )
            for i, logprobs in zip(local, scored):
                completions[i].logprobs = list(logprobs)
        # Server rescoring runs after all sampling and one request at a time: a batch that
        # mixes prompt logprobs with other requests breaks vLLM's LoRA logits path (0.32,
        # CPU).
        for i in remote:
            self._rescore(requests[i], completions[i])
        for request, completion in zip(requests, completions):
            if request.on_token is not None:  # not streamed: told once the reply is back
                tops = completion.top_logprobs or [None] * len(completion.ids)
                for token, logp, top in zip(completion.ids, completion.logprobs, tops):
                    request.on_token(token, logp, top)
            if request.on_complete is not None:
                request.on_complete()
        return completions

    def _sample(self, request: GenerationRequest, params: SamplingParams, seed: int) -> Completion:
        limit = min(params.max_new_tokens, request.max_new_tokens or params.max_new_tokens)
        body: dict[str, Any] = {
            "model": self.served,
            "prompt": list(request.prompt_ids),
            "max_tokens": limit,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "seed": seed,
            "logprobs": request.top_logprobs,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "stop_token_ids": self.stop_token_ids,
            "stop": params.stop or None,
            "skip_special_tokens": False,
        }
        if request.constraint is not None:
            body["structured_outputs"] = {"grammar": self._grammar(request.constraint)}
        choice = self.server.post("/v1/completions", body)["choices"][0]
        ids = list(choice["token_ids"])
        logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        top = None
        if request.top_logprobs:
            top = [
                _pairs(entry, request.top_logprobs) for entry in choice["logprobs"]["top_logprobs"]
            ]
        finish = "length" if choice["finish_reason"] == "length" else "stop"
        return Completion(ids, logprobs, finish, top)

    def _rescore(self, request: GenerationRequest, completion: Completion) -> None:
        """Replace a constrained completion's (masked) logprobs by the unconstrained
        ones: the completion appended to the prompt, scored by one prefill."""
        if not completion.ids:
            return
        body = {
            "model": self.served,
            "prompt": list(request.prompt_ids) + completion.ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": max(request.top_logprobs, 0),
        }
        scored = self.server.post("/v1/completions", body)["choices"][0]["prompt_logprobs"]
        tail = scored[-len(completion.ids) :]
        completion.logprobs = [
            float(entry[str(token)]["logprob"]) for entry, token in zip(tail, completion.ids)
        ]
        if request.top_logprobs:
            completion.top_logprobs = [
                sorted(
                    ((int(k), float(v["logprob"])) for k, v in entry.items()),
                    key=lambda pair: -pair[1],
                )[: request.top_logprobs]
                for entry in tail
            ]

    def _grammar(self, constraint: Constraint) -> str:
        """The EBNF text of the `hf` engine's grammar for this constraint (cached)."""
        from looprl.engine.grammar import build_grammar

        key = json.dumps(constraint.__dict__, default=str)
        if key not in self._grammars:
            self._grammars[key] = str(build_grammar(constraint))
        return self._grammars[key]


def _pairs(entry: dict[str, float] | None, k: int) -> list[tuple[int, float]]:
    """A completions `top_logprobs` entry ({"token_id:N": logprob}) as (id, logprob)
    pairs, most likely first."""
    pairs = [(int(key.split(":", 1)[1]), float(v)) for key, v in (entry or {}).items()]
    return sorted(pairs, key=lambda pair: -pair[1])[:k]


def save_base_model(model: Any, tokenizer: Any, folder: Path) -> None:
    """The policy's base weights (LoRA layers left out) and its tokenizer, as a model
    folder vLLM loads."""
    base = base_model(model)
    state = {
        name.replace(".base_layer", ""): tensor
        for name, tensor in base.state_dict().items()
        if "lora_" not in name
    }
    base.save_pretrained(str(folder), state_dict=state)
    tokenizer.save_pretrained(str(folder))
