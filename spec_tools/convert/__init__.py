"""`spec convert`: prepare what speculative decoding loads.

    corpus.py        texts for token maps and prompt sets for generation (files, named sets, built-in instructions)
    instructions.py  the built-in set of MT-Bench-like instructions (writing, coding, math, ...)
    magpie.py        prompts the target writes itself from its chat template (the source `magpie`)
    generate.py      the target's own answers to a prompt set, generated in batches by the Engine
    token_map.py     FR-Spec token maps: token frequencies, the top ids, coverage; EAGLE-3 d2t/t2d from ids
    draft_io.py      import EAGLE / EAGLE-3 drafts (EAGLE repo, SGLang, SpecForge, speculators), validate
                     them against a target, apply a token map, write the layout `spec serve` loads
    eagle3_data.py   on-policy training data: answers plus the target's hidden states, in shards on disk
    data_manifest.py what a data directory was made with, prompt by prompt: reuse, grow, or refuse
    ttt.py           EAGLE-3's training-time test: the draft unrolled over its own outputs, and its loss
    train_eagle3.py  the training loop: checkpoints, resume, progress, the saved head and its report
"""

from engine.errors import SpecError


class ConvertError(SpecError):
    """A conversion cannot run as asked: bad input file, incompatible draft, missing data."""
