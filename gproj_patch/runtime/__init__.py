"""The patch's runtime: options (config), the one runtime state and its reset (state), counters
and fallback reasons (telemetry), after-import hooks (import_hooks).
"""
