"""One file per hooked attention op, each with its autograd Function (forward record, corrected backward)."""
