"""Checkpoint I/O of the installed package (a save's remote code does not carry it): directories written beside and
swapped in (`atomic_dir`), the reader side of `from_pretrained` (`loading`), unreadable weight files named
(`weight_files`), the authors' released layout (`released_format`) and the weights' fingerprint (`fingerprint`)."""
