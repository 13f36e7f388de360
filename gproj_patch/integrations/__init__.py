"""How a user turns the patch on without calling ``enable()``: the HF Trainer callback (``trainer.py``) and the
``GPROJ_PATCH=1`` interpreter start-up hook (``startup.py``). Both call ``patch.enable()``; the attention hooks
it installs are ``gproj_patch/hooks/``."""
