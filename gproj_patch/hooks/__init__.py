"""The attention hooks: one module per target of ``runtime/hooks.py`` (PyTorch SDPA's backward ops, flash-attn,
HF Transformers' registries, HF eager attention, FlexAttention, PyTorch's context-parallel ring), each with
``install()`` / ``uninstall()`` and its corrected backward, and the helpers they share (``fa_records``,
``flex_masks``, ``flex_reach``, ``hf_eager_forms``, ``hf_layer_names``; ``restore.py``: how every hook puts the
original back at ``disable()``). ``patch.py`` installs them; nothing here imports it."""
