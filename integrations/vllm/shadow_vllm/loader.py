"""vLLM's weights through the GPU Memory Service (``--load-format gms``).

Why: the two engines of a pair must not each hold a copy of the weights.
The first engine of a pair to reach its loader gets the write lease from
gmsd (lease mode ``rw_or_ro``), loads the checkpoint with vLLM's own
loader, copies every parameter and buffer into one GMS allocation, records
where each tensor lies and the weights digest, and commits; the commit
makes the memory read-only, and the engine goes on with the committed copy.
Every later engine gets a read-only lease, builds the model on the 'meta'
device (no memory, no checkpoint read) and points each parameter and
buffer at the committed copy, mapped at the writer's addresses, after
checking the weights digest once.

The same code runs on both GMS backends; only the step that turns an
address into a tensor differs (``shadow_gms.client.Gms.tensor_at``):

- vLLM's CPU build: gmsd ``--device host``, socket
  ``$GMS_SOCKET_DIR/gms-host.sock``; memfds sealed at commit, mapped
  ``PROT_READ`` by every engine, so the pages are gmsd's and counted once.
- a CUDA build: the gmsd of the worker's GPU (``gms-<GPU-UUID>.sock``),
  through libgms's CUDA mapper, as the torch engine uses it.

The committed weights are read-only in every engine, the writer included:
whatever would write a weight in place after loading must not run. vLLM's
``process_weights_after_loading`` runs after the weights are in GMS, in
every engine alike. What it does to an unquantized model is to replace
the large tensors (never to write into them) and to write a few small ones
in place (the attention layers' scales are filled with 1.0): tensors under
``PRIVATE_BELOW`` bytes (scales, norms, biases: kilobytes) are therefore
copied into each engine's own memory from the committed layout, and only
the large ones are used where GMS maps them. Quantized models, whose
processing rewrites large weights, are refused before anything is
committed; a write that still reaches the shared weights is SIGSEGV in the
engine that tries it, never a change the other engine sees.

The CPU build's repack (``SHADOW_VLLM_REPACK``): vLLM's CPU backend copies
each linear weight into private memory in a kernel's layout (oneDNN, or the
AMX "sgl" kernel) and drops the original; each engine would then keep its
own copy and the sharing would save nothing. ``SHADOW_VLLM_REPACK=0`` (the
default) keeps the linear weights where GMS maps them and multiplies with
``torch.nn.functional.linear``; ``=1`` repacks as vLLM does (each engine
pays the memory, gmsd still saves the checkpoint read). The figures behind
the default are in docs/vllm.md. On CUDA the setting changes nothing.

vLLM internals this module relies on (vLLM 0.32): ``register_model_loader``
and ``BaseModelLoader`` (``load_model``, ``create_model``),
``DefaultModelLoader.load_weights``, ``process_weights_after_loading`` of
``model_loader.utils``, ``set_default_torch_dtype``, the CPU linear
layers' ``_cpu_skip_gemm_dispatch`` attribute (which makes
``UnquantizedLinearMethod`` use ``torch.nn.functional.linear`` instead of
repacking), ``UnquantizedEmbeddingMethod`` (its post-load step replaced in
the LM head) and the ``cpu_linear`` attribute both set.

Settings (environment, read in the worker process):

- ``GMS_SOCKET_DIR``: where gmsd's socket is (the runtime sets it in a
  pair; default ``/run/shadow/gms``);
- ``GMS_LIB``: libgms.so (``shadow_gms.client.find_library``);
- ``SHADOW_VLLM_GMS_TIMEOUT_S``: how long to wait for gmsd and for the
  other engine's load (600);
- ``SHADOW_VLLM_REPACK``: 0 (default) or 1, above.
"""

import dataclasses
import os
import time

import torch

LOAD_FORMAT = "gms"
# Tensors smaller than this are each engine's own copy (module docstring).
PRIVATE_BELOW = 1 << 20
REPACK_VAR = "SHADOW_VLLM_REPACK"
TIMEOUT_VAR = "SHADOW_VLLM_GMS_TIMEOUT_S"

# The lease lives as long as the worker process: its connection is the
# lease, and the mappings the model uses die with it.
_gms = None


class GmsLoadError(RuntimeError):
    pass


def repack_enabled():
    """SHADOW_VLLM_REPACK: 0 (default) or 1; anything else is an error a
    person can fix."""
    value = os.environ.get(REPACK_VAR, "0").strip()
    if value not in ("0", "1"):
        raise GmsLoadError(f"{REPACK_VAR}={value!r}: 0 (weights used in place, shared) or 1 (vLLM's repack)")
    return value == "1"


def session():
    """The process's GMS lease, or None before the loader ran."""
    return _gms


def verify_weights():
    """Checks the committed weights against their digest (``Gms.verify_weights``):
    for an engine to call on promotion, before its first answer. None when
    this process did not load through GMS."""
    return None if _gms is None else _gms.verify_weights()


def connect(device):
    global _gms
    if _gms is not None:
        raise GmsLoadError("this process already loaded a model through GMS: one model per engine")
    from shadow_gms.client import Gms

    timeout = float(os.environ.get(TIMEOUT_VAR, "600"))
    _gms = Gms(mode="rw_or_ro", client=f"vllm-{os.getpid()}", device=device, timeout_s=timeout)
    return _gms


def refuse_in_place_writers(model):
    """Refuses a model whose post-load processing may write weights in place
    (quantization methods other than the unquantized ones, online
    quantization): GMS weights are read-only once committed."""
    allowed = {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        kind = type(method).__name__
        if kind not in allowed or getattr(method, "uses_meta_device", False):
            raise GmsLoadError(
                f"layer {name or '<root>'} uses {kind}: --load-format {LOAD_FORMAT} serves "
                "unquantized weights only (quantized weights are processed in place after "
                "loading, and GMS weights are read-only)")


def keep_linear_weights_in_place(model):
    """CPU build without the repack: every linear layer, and the LM head,
    multiplies with torch.nn.functional.linear over the shared weight
    (vLLM's own fallback). Linear layers are told through
    ``_cpu_skip_gemm_dispatch``; the embedding method (the LM head's) has
    no such switch and would keep a packed copy beside its weight, so its
    post-load step is replaced by one that only selects the fallback.
    Returns how many layers it set."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    class SharedEmbeddingMethod(UnquantizedEmbeddingMethod):
        def process_weights_after_loading(self, layer):
            layer.cpu_linear = torch.nn.functional.linear

    n = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedLinearMethod):
            module._cpu_skip_gemm_dispatch = True
            n += 1
        elif type(method) is UnquantizedEmbeddingMethod:
            shared = SharedEmbeddingMethod.__new__(SharedEmbeddingMethod)
            shared.__dict__.update(method.__dict__)
            module.quant_method = shared
            n += 1
    return n


def privatize_small(model, limit=PRIVATE_BELOW):
    """Gives every parameter and buffer under ``limit`` bytes a private,
    writable copy of its committed value. Returns (tensors, bytes) copied."""
    n = nbytes = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        size = t.numel() * t.element_size()
        if size >= limit:
            continue
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        if leaf in owner._parameters:
            owner._parameters[leaf].data = t.detach().clone()
        else:
            owner._buffers[leaf] = t.clone()
        n, nbytes = n + 1, nbytes + size
    return n, nbytes


def _check_parallelism(vllm_config):
    p = vllm_config.parallel_config
    if p.tensor_parallel_size * p.pipeline_parallel_size != 1:
        raise GmsLoadError(
            f"--load-format {LOAD_FORMAT}: one worker per engine (tensor parallel "
            f"{p.tensor_parallel_size}, pipeline parallel {p.pipeline_parallel_size}); each rank "
            "would need its own GMS daemon")


def _no_meta_left(model):
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise GmsLoadError(f"{len(left)} tensor(s) were not in the committed layout, e.g. {left[:3]}")


def gms_device(target):
    """The GMS backend for vLLM's load device: ``"host"`` for the CPU, the
    CUDA device index for a GPU; anything else is refused."""
    if target.type == "cpu":
        return "host"
    if target.type == "cuda":
        return target.index if target.index is not None else torch.cuda.current_device()
    raise GmsLoadError(f"--load-format {LOAD_FORMAT}: no GMS backend for device {target}")


def load_through_gms(gms, build, load_checkpoint, target):
    """The GMS part of the loader, without vLLM: what a pair's engines do
    with their lease. ``build()`` makes the model under the current device
    context, ``load_checkpoint(model)`` fills it from the checkpoint, and
    ``target`` is the device the writer builds on. The writer (``rw``
    lease) builds on ``target``, loads, publishes and commits; a reader
    builds on 'meta', maps the committed copy and checks its digest.
    Either way every tensor under ``PRIVATE_BELOW`` bytes is then the
    engine's own copy.

    Returns (model, facts): ``facts`` says what was done, for the log and
    the tests: ``committed`` (the writer: the generation) or ``checked``
    (a reader: ``Gms.verify_weights``'s answer), and ``private`` (tensors,
    bytes) copied. This is the code the GPU tests run on CUDA (run.py's
    ``test_vllm_loader_gms_part``, through tests/gms_child.py): vLLM's CUDA
    build cannot run on the GPU machine, this part can."""
    facts = {}
    if gms.lease == "rw":
        with target:
            model = build()
        refuse_in_place_writers(model)
        load_checkpoint(model)
        facts["committed"] = gms.publish_module(model)
    else:
        with torch.device("meta"):
            model = build()
        refuse_in_place_writers(model)
        gms.load_module(model)
        _no_meta_left(model)
        facts["checked"] = gms.verify_weights()
    facts["private"] = privatize_small(model)
    return model, facts


def describe(facts):
    """One phrase of what ``load_through_gms`` did, for the log."""
    if "committed" in facts:
        return f"loaded from the checkpoint and committed (generation {facts['committed']})"
    return f"mapped read-only from GMS (digest checked: {facts['checked']})"


def make_loader_class():
    """The loader class (vLLM imported here, not at module import)."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.logger import init_logger
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import set_default_torch_dtype

    log = init_logger("vllm.shadow_vllm.loader")

    class GmsModelLoader(BaseModelLoader):
        """``--load-format gms``: module docstring."""

        def __init__(self, load_config):
            super().__init__(load_config)
            # vLLM's own loader reads the checkpoint for the first engine.
            self._checkpoint = DefaultModelLoader(dataclasses.replace(load_config, load_format="auto"))

        def download_model(self, model_config):
            self._checkpoint.download_model(model_config)

        def load_weights(self, model, model_config):
            # vLLM calls this to reload weights into a live model: GMS
            # weights are read-only and shared by the pair.
            raise GmsLoadError(f"--load-format {LOAD_FORMAT}: the weights are shared and read-only; "
                               "reloading them in place is not supported")

        def load_model(self, vllm_config, model_config, prefix=""):
            _check_parallelism(vllm_config)
            load_device = vllm_config.load_config.device or vllm_config.device_config.device
            target = torch.device(load_device)
            device = gms_device(target)
            repack = repack_enabled()
            t0 = time.perf_counter()
            gms = connect(device)
            with set_default_torch_dtype(model_config.dtype):
                model, facts = load_through_gms(
                    gms,
                    lambda: self.create_model(vllm_config=vllm_config, model_config=model_config,
                                              prefix=prefix),
                    lambda m: self._checkpoint.load_weights(m, model_config),
                    target)
                if current_platform.is_cpu() and not repack:
                    keep_linear_weights_in_place(model)
                process_weights_after_loading(model, model_config, target)
            log.info("shadow-vllm: weights %s in %.2f s (%s, %s=%d)", describe(facts), time.perf_counter() - t0,
                        "host" if device == "host" else f"cuda:{device}", REPACK_VAR, int(repack))
            return model.eval()

    return GmsModelLoader


_registered = False


def register():
    """vLLM general plugin (entry point ``shadow_gms_loader``): registers
    ``--load-format gms`` in each of vLLM's processes. Selecting another
    load format leaves everything as it was."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(LOAD_FORMAT)(make_loader_class())
    _registered = True
