"""The explicit-state checker over the protocol core, the model catalogue (.cfg files, the bug zoo)
and the reports and tables generated from its runs."""
