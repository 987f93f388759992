"""TLA+ tooling: an evaluator for the spec's TLA+ subset (on the `tla` parser), the view of core
states as spec variables, ITF traces, trace validation, conformance of core and spec, the TLC runner."""
