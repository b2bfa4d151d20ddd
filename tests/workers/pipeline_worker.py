"""transformers' own text generation on a folder, as a user runs it: ``pipeline("text-generation",
model=FOLDER)``, greedy, nothing but the folder. Prints the generated text as one JSON string."""

import json
import sys

from transformers import pipeline

folder, prompt, new = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = pipeline("text-generation", model=folder)(prompt, max_new_tokens=new, do_sample=False)
print(json.dumps(out[0]["generated_text"]))
