"""hf-to-meta-llama: peak anonymous memory (RssAnon, sampled every 2 ms) of a warm migration of a
~214 MiB Llama into 1 or N consolidated shards (not collected by pytest). torch.save pickles a whole
dict per file, so meta_files spills each fetched tensor and maps it back privately: the growth
should stay near one rule group (the 62 MiB embedding), not the checkpoint.

    python tests/bench/convert_meta_memory.py SHARDS
"""
import os, sys, threading, time, tempfile, gc
import torch, transformers, checkpoint
def kib(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field))
cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
d = tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR", "/tmp"))  # on tmpfs, file pages are shmem
m = transformers.LlamaForCausalLM(cfg)
checkpoint.save(m, d + "/hf"); total = sum(p.nbytes for p in m.state_dict().values()); del m; gc.collect()
checkpoint.migrate(d + "/hf", d + "/warm", recipe="hf-to-meta-llama", dims={"shards": int(sys.argv[1])})
gc.collect()
anon = {"peak": kib("RssAnon"), "run": True}; base = anon["peak"]
def s():
    while anon["run"]:
        anon["peak"] = max(anon["peak"], kib("RssAnon")); time.sleep(0.002)
threading.Thread(target=s, daemon=True).start()
checkpoint.migrate(d + "/hf", d + "/meta", recipe="hf-to-meta-llama", dims={"shards": int(sys.argv[1])})
anon["run"] = False
print(f"shards {sys.argv[1]}: checkpoint {total/2**20:.0f} MiB, largest tensor {32000*512*4/2**20:.0f} MiB, anon growth {(anon['peak']-base)/1024:.1f} MiB")
import shutil; shutil.rmtree(d)
