# The vendored suites under tests/external/vendor/ are run only by the runners
# (tests/integrations/test_external_torch_sdpa.py, python -m benchmarks.external_suites), each in a subprocess with its
# own options, with the patch off and on. The repository's own pytest run must not collect them.
collect_ignore = ["vendor"]
collect_ignore_glob = ["vendor/*"]
