"""Every private upstream API the package touches, in one place, with the versions it was checked against.

Each touch-point is a small function (or, for names only, a constant) that either does its job or raises
``CompatError`` naming what changed — never a silently wrong result. ``tests/contract/test_structure.py``
exercises each one on the installed versions, so an upstream change fails loudly in CI. Checked against: torch
2.11.0+cu130 (the GPU image) and 2.13.0 (CPU); transformers 5.17 (GPU) and 5.25 (CPU); triton 3.6.0;
flash-attn-4 4.0.0b36. Imports of triton, transformers and flash-attn happen inside the functions: this package
imports without them.

| touch-point | upstream private name | checked | used by |
|---|---|---|---|
| ``op_overload``, ``autograd_library``, ``register_autograd_kernel``, ``destroy_library``, ``redispatch_native``, ``redispatch_reentrant`` | ``torch.library.Library(ns, "IMPL").impl(..., with_keyset=True)`` at ``AutogradCUDA`` / ``AutogradCPU``, ``Library._destroy``, ``torch._C._after_autograd_keyset``, ``torch._C._AutoDispatchBelowAutograd``, ``OpOverload.redispatch`` | torch 2.11 (H100), 2.13 | the SDPA seam |
| ``dispatch_mode_active``, ``current_autograd_node``, ``autograd_sequence_nr``, ``node_sequence_nr`` | ``torch._C._len_torch_dispatch_stack``, ``torch._C._current_autograd_node``, ``torch._C._autograd._get_sequence_nr``, ``Node._sequence_nr`` | torch 2.11, 2.13 | the SDPA seam, layer names |
| ``FUSED_SDPA_NODES``, ``fused_sdpa_node``, ``fused_sdpa_lse``, ``FUSED_NODE_FORMULAS``, ``fused_node_backward`` | ``ScaledDotProduct{Cudnn,Flash,FlashForCpu,Efficient}AttentionBackward0``, their ``_saved_*`` fields and ``derivatives.yaml`` formulas | torch 2.11, 2.13 | ``gproj_patch.attention`` without ``enable()`` |
| ``functorch_transform_active()``, ``forward_ad_active()``, ``saved_tensors_hooks_enabled()``, ``saved_tensors_default_hooks_active()``, ``graph_task_id()``, ``delayed_error(message, outputs)`` | ``torch._C._functorch.peek_interpreter_stack``, ``torch.autograd.forward_ad._current_level``, ``torch._C._autograd._saved_tensors_hooks_is_enabled``, ``torch._C._autograd._top_saved_tensors_default_hooks``, ``torch._C._current_graph_task_id``, ``torch._C._functions.DelayedError`` (what ``once_differentiable`` uses) | torch 2.11, 2.13 (the hook-stack reader and the graph-task id are torch 2.8+ / 2.1+ readers; absent ones are answered conservatively) | hooked calls' autograd (``dispatch/autograd.py``), steps |
| ``CUDAGRAPH_UNSAFE_TAGS`` | ``torch.Tag.cudagraph_unsafe`` (a custom op inductor keeps out of CUDA-graph partitions) | torch 2.11, 2.13 | compiled flex hook |
| ``custom_op_def(qualname)`` and its accessors | ``torch._library.custom_ops.OPDEFS``; ``CustomOpDef._backend_fns``, ``_init_fn``, ``_abstract_fn`` | torch 2.11, 2.13 | flash-attn hook |
| ``FA2_BACKWARD_OPS``, ``FA3_BACKWARD_OPS`` | flash-attn's private backward ops ``flash_attn::_flash_attn_{,varlen_}backward`` (``flashattn::`` too, where a build defines it), ``flash_attn_3::_flash_attn_backward`` (schemas read from flash-attention's ``flash_attn/flash_attn_interface.py`` and ``hopper/flash_attn_interface.py``) | flash-attn 2.7–2.8, FA3 | flash-attn hook |
| ``fa4_interface()`` | ``flash_attn.cute.interface._flash_attn_bwd`` / ``_flash_attn_fwd`` (module functions its autograd Functions look up as globals) | flash-attn-4 4.0.0b36 | flash-attn hook |
| ``hf_registry_mapping(registry)`` | ``transformers`` ``AttentionInterface._global_mapping`` (and the mask interface's) | transformers 5.17, 5.25 | HF hooks |
| ``context_parallel_attention_module()``, ``CP_ATTENTION_MODULE``, ``RING_BACKWARD``, ``RING_NAMES`` | that module's ``_templated_ring_attention_backward`` (a module global its ``_scaled_dot_product_ring_*_backward`` functions look up at call time), ``_create_rotater``, ``_RotateMethod``, ``_AllGatherRotater``, ``_is_causal_behavior``, ``_CausalBehavior``, ``_partial_update``, ``_cp_options`` (``convert_to_f32``, ``enable_load_balance``) | torch 2.11 (read), 2.13 (CPU gloo rings) | context-parallel hook |
| ``dynamo_module_name()`` | the module ``torch._dynamo`` (imported first by ``torch.compile``) | torch 2.11, 2.13 | flex hook |
| ``assume_constant_result(fn)`` | ``torch._dynamo.assume_constant_result`` | torch 2.11, 2.13 | compiled flex hook |
| ``flex_identity_score_mod()``, ``FLEX_SLICED_MASK_MOD`` | ``torch.nn.attention.flex_attention._identity``; the stub name flex puts in a sliced BlockMask | torch 2.11, 2.13 | flex hook |
| ``load_interpreted_module(name, path, interpret)`` | ``triton.knobs.runtime.interpret`` and ``knobs.runtime.scope()`` | triton 3.6 | Triton kernel on CPU |
| ``triton_interpreter_index_patch()`` | ``triton.runtime.interpreter._patch_lang_tensor`` | triton 3.6 | Triton kernel on CPU |
| ``compiled_launcher(kernel)``, ``launch_hooks_set()`` | ``CompiledKernel.run(...)``; ``triton.knobs.runtime.launch_enter_hook`` / ``launch_exit_hook`` | triton 3.6 | prepared launches (host cost) |
| ``current_cuda_stream(index)`` | ``torch._C._cuda_getCurrentRawStream`` | torch 2.11, 2.13 | prepared launches |
| ``gluon_unsupported_reason(version)`` | ``triton.experimental.gluon`` (``warp_specialize``'s signature, ``warpgroup_mma_init``, rank-1 ``NVMMASharedLayout`` TMA boxes) | triton 3.6 | Gluon kernels |

This package imports nothing from the rest of gproj_patch. Its modules: ``pytorch`` (PyTorch and the libraries
registered through it: flash-attn, Transformers), ``triton_runtime`` (Triton), ``errors``; each lists its names
once, in its ``__all__``, and they are re-exported here, so callers write ``compat.NAME``.
"""
from __future__ import annotations

from . import pytorch as _pytorch
from . import triton_runtime as _triton_runtime
from .errors import CompatError
from .pytorch import *  # noqa: F401,F403 - the names of its __all__
from .triton_runtime import *  # noqa: F401,F403 - the names of its __all__

__all__ = ["CompatError", *_pytorch.__all__, *_triton_runtime.__all__]
