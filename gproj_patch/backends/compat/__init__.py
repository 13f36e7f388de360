"""Every private upstream API the package touches, in one place, with the versions it was checked against.

Each touch-point is a small function (or, for names only, a constant) that either does its job or raises
``CompatError`` naming what changed — never a silently wrong result. ``tests/test_structure.py`` exercises each
one on the installed versions, so an upstream change fails loudly in CI. Checked against: torch 2.11.0+cu130 (the
H200 image) and 2.13.0 (CPU); transformers 5.17 (H200) and 5.24 (CPU); triton 3.6.0; flash-attn-4 4.0.0b36.
Imports of triton, transformers and flash-attn happen inside the functions: this module imports without them.

| touch-point | upstream private name | checked | used by |
|---|---|---|---|
| ``fused_sdpa_lse(grad_fn)`` | ``ScaledDotProduct{Cudnn,Flash,FlashForCpu,Efficient}AttentionBackward0`` and their ``_saved_logsumexp`` / ``_saved_log_sumexp`` | torch 2.11, 2.13 | SDPA hook |
| ``overrides_torch_function(cls)`` | ``torch._C._disabled_torch_function_impl`` (a subclass that opted out of ``__torch_function__``) | torch 2.11, 2.13 | SDPA hook |
| ``functorch_transform_active()``, ``forward_ad_active()``, ``saved_tensors_hooks_enabled()``, ``saved_tensors_default_hooks_active()``, ``graph_task_id()``, ``delayed_error(message, outputs)`` | ``torch._C._functorch.peek_interpreter_stack``, ``torch.autograd.forward_ad._current_level``, ``torch._C._autograd._saved_tensors_hooks_is_enabled``, ``torch._C._autograd._top_saved_tensors_default_hooks``, ``torch._C._current_graph_task_id``, ``torch._C._functions.DelayedError`` (what ``once_differentiable`` uses) | torch 2.13; on 2.11 (H200 runs 42–43, every hooked call) the first four and ``DelayedError``; the hook-stack reader and the graph-task id are torch 2.8+ / 2.1+ readers, absent ones answered conservatively (not yet run on 2.11) | hooked calls' autograd (``dispatch/autograd.py``), SDPA/flex forwards |
| ``CUDAGRAPH_UNSAFE_TAGS`` | ``torch.Tag.cudagraph_unsafe`` (a custom op inductor keeps out of CUDA-graph partitions) | torch 2.11 (H200 run 49), 2.13 | compiled SDPA and flex hooks |
| ``custom_op_def(qualname)`` | ``torch._library.custom_ops.OPDEFS``; ``CustomOpDef._backend_fns``, ``_init_fn``, ``_abstract_fn`` | torch 2.11, 2.13 | flash-attn hook |
| ``FA2_BACKWARD_OPS``, ``FA3_BACKWARD_OPS``, ``FA_FORWARD_OPS`` | flash-attn's private ops ``flash_attn::_flash_attn_{,varlen_}{forward,backward}`` (``flashattn::`` in newer FA2), ``flash_attn_3::_flash_attn_{forward,backward}`` | flash-attn 2.7–2.8, FA3 (H200 image) | flash-attn hook |
| ``fa4_interface()`` | ``flash_attn.cute.interface._flash_attn_bwd`` / ``_flash_attn_fwd`` (module functions its autograd Functions look up as globals; JIT cache ``compile_cache`` on the function) | flash-attn-4 4.0.0b36 | flash-attn hook |
| ``hf_registry_mapping(registry)`` | ``transformers`` ``AttentionInterface._global_mapping`` (and the mask interface's) | transformers 5.17, 5.24 | HF hooks |
| ``is_context_parallel_wrapper(fn)`` | ``torch.distributed.tensor.experimental._context_parallel._attention._replaced_functions`` | torch 2.11, 2.13 | SDPA hook |
| ``context_parallel_attention_module()``, ``RING_BACKWARD``, ``RING_NAMES`` | that module's ``_templated_ring_attention_backward`` (a module global its ``_scaled_dot_product_ring_*_backward`` functions look up at call time), ``_create_rotater``, ``_RotateMethod``, ``_AllGatherRotater``, ``_is_causal_behavior``, ``_CausalBehavior``, ``_partial_update``, ``_cp_options`` (``convert_to_f32``, ``enable_load_balance``) | torch 2.11 (read), 2.13 (CPU gloo rings) | context-parallel hook |
| ``register_torchscript_builtin(fn, op)`` | ``torch.jit._builtins._register_builtin`` | torch 2.11, 2.13 | SDPA hook (TorchScript) |
| ``dynamo_module_name()`` | the module ``torch._dynamo`` (imported first by ``torch.compile``; its import loads the compiled flex path) | torch 2.11, 2.13 | flex hook |
| ``BUILTIN_SDPA`` | ``torch._C._nn.scaled_dot_product_attention`` (the C builtin behind ``F.scaled_dot_product_attention``) | torch 2.11, 2.13 | SDPA hook |
| ``assume_constant_result(fn)`` | ``torch._dynamo.assume_constant_result`` (a trace-time call folded to its result) | torch 2.11, 2.13 | compiled flex hook |
| ``flex_identity_score_mod()``, ``FLEX_SLICED_MASK_MOD`` | ``torch.nn.attention.flex_attention._identity``; the name of the stub flex puts in a sliced BlockMask (``_sliced_mask_mod_error``) | torch 2.11, 2.13 | flex hook |
| ``load_interpreted_module(name, path, interpret)`` | ``triton.knobs.runtime.interpret`` (read when a file's ``@triton.jit`` decorators run) and ``knobs.runtime.scope()`` | triton 3.6 | Triton kernel on CPU |
| ``triton_interpreter_index_patch()`` | ``triton.runtime.interpreter._patch_lang_tensor`` | triton 3.6 | Triton kernel on CPU |
| ``compiled_launcher(kernel)``, ``launch_hooks_set()`` | ``CompiledKernel.run(gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``; ``triton.knobs.runtime.launch_enter_hook`` / ``launch_exit_hook`` | triton 3.6 | prepared launches (host cost) |
| ``current_cuda_stream(index)`` | ``torch._C._cuda_getCurrentRawStream`` | torch 2.11, 2.13 | prepared launches |
| ``gluon_unsupported_reason(version)`` | ``triton.experimental.gluon`` (experimental: ``warp_specialize``'s signature, ``warpgroup_mma_init``, rank-1 ``NVMMASharedLayout`` TMA boxes) | triton 3.6 | Gluon KV-major kernel |

This package imports nothing from the rest of gproj_patch. Its modules: ``pytorch`` (PyTorch and the libraries
registered through it: flash-attn, Transformers), ``triton_runtime`` (Triton), ``errors``; every name is
re-exported here, so callers write ``compat.NAME``.
"""
from __future__ import annotations

from .errors import CompatError
from .pytorch import (BUILTIN_SDPA, assume_constant_result, FLEX_SLICED_MASK_MOD, flex_identity_score_mod,
    FUSED_SDPA_NODES, fused_sdpa_node, fused_sdpa_lse, overrides_torch_function, functorch_transform_active,
    forward_ad_active, saved_tensors_hooks_enabled, saved_tensors_default_hooks_active, graph_task_id, delayed_error,
    CUDAGRAPH_UNSAFE_TAGS, custom_op_def, custom_op_kernel, set_custom_op_kernel, custom_op_fake,
    custom_op_signature_fn, FA2_BACKWARD_OPS, FA3_BACKWARD_OPS, FA_FORWARD_OPS, FA4_INTERFACE, FA4_BACKWARD,
    FA4_FORWARD, fa4_interface, hf_registry_mapping,
    is_context_parallel_wrapper, context_parallel_attention_module, RING_BACKWARD, RING_NAMES,
    register_torchscript_builtin, dynamo_module_name, FusedSdpaOp, SDPA_FUSED_OPS,
    FusedSdpaCall, sdpa_fused_call, sdpa_fused_backward)
from .triton_runtime import (load_interpreted_module, triton_interpreter_index_patch, GLUON_CHECKED_TRITON,
    gluon_unsupported_reason, LAUNCHER_CHECKED_TRITON, compiled_launcher, launch_hooks_set, current_cuda_stream)

__all__ = ["CompatError", "BUILTIN_SDPA", "assume_constant_result", "FLEX_SLICED_MASK_MOD", "flex_identity_score_mod",
           "FUSED_SDPA_NODES", "fused_sdpa_node", "fused_sdpa_lse", "overrides_torch_function",
           "functorch_transform_active", "forward_ad_active", "saved_tensors_hooks_enabled",
           "saved_tensors_default_hooks_active", "graph_task_id", "delayed_error", "CUDAGRAPH_UNSAFE_TAGS",
           "custom_op_def", "custom_op_kernel", "set_custom_op_kernel", "custom_op_fake", "custom_op_signature_fn",
           "FA2_BACKWARD_OPS", "FA3_BACKWARD_OPS", "FA_FORWARD_OPS", "FA4_INTERFACE", "FA4_BACKWARD",
           "FA4_FORWARD", "fa4_interface", "hf_registry_mapping", "is_context_parallel_wrapper",
           "context_parallel_attention_module", "RING_BACKWARD", "RING_NAMES",
           "register_torchscript_builtin", "dynamo_module_name", "FusedSdpaOp", "SDPA_FUSED_OPS",
           "FusedSdpaCall", "sdpa_fused_call", "sdpa_fused_backward", "load_interpreted_module",
           "triton_interpreter_index_patch", "GLUON_CHECKED_TRITON", "gluon_unsupported_reason",
           "LAUNCHER_CHECKED_TRITON", "compiled_launcher", "launch_hooks_set", "current_cuda_stream"]
