"""Runs inside the vLLM server's workers, never in looprl's own process.

vLLM imports this file by name (`--worker-extension-cls looprl_vllm_worker.WeightSync`, with this
folder on the server's PYTHONPATH), so it imports nothing from looprl: the server runs
in its own environment (`.venv-vllm`), which has vLLM's dependencies and not looprl's.

Full fine-tuning pushes the trainer's changed weights into the workers: the trainer
writes them to a safetensors file, and the server's dev-mode `/collective_rpc` route
calls `looprl_load_weights(path)` on every worker, which reloads them in place through
vLLM's own `reload_weights` (it maps Hugging Face names onto vLLM's fused layers and
repeats the processing done after loading, such as the CPU backend's weight packing).
"""

from __future__ import annotations


class WeightSync:
    """Mixed into vLLM's worker class; `self.model_runner` is the worker's."""

    def looprl_load_weights(self, path: str) -> int:
        from safetensors.torch import load_file

        tensors = load_file(path)
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
        _retie_head(self.model_runner.get_model())
        return len(tensors)


def _retie_head(model) -> None:
    """With tied embeddings the checkpoint has no `lm_head.weight`, so an in-place reload
    skips the output layer: make sure it holds the new embedding, and redo its
    processing (on CPUs, a prepacked copy of the weight that its matrix product uses)."""
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not getattr(config, "tie_word_embeddings", False) or head is None or embed is None:
        return
    if head.weight.data_ptr() != embed.weight.data_ptr():
        if head.weight.shape != embed.weight.shape:
            raise RuntimeError(
                f"cannot re-tie the output layer: {tuple(head.weight.shape)} vs "
                f"{tuple(embed.weight.shape)}"
            )
        head.weight.data.copy_(embed.weight.data)
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
