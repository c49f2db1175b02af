"""Published checkpoints: the SPD authors' released speculation heads.

- :mod:`spd.heads.published.authors_file` - where a head file is (local path or ``hf://`` reference), loading it
  safely (``weights_only=True``) and validating it, with one clear sentence for every bad file;
- :mod:`spd.heads.published.authors_head` - their v10 and v11 heads as modules, run with the decode schedule
  they were trained for, inside our engine;
- :mod:`spd.heads.published.authors_config` - their config read and checked against the target;
- :mod:`spd.heads.published.convert` - their ``.pt`` files to our directory format and back (``spd-convert``).
"""
