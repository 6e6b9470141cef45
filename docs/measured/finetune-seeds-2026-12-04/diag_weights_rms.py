from safetensors.torch import load_file
k=load_file('/tmp/ttq-amx3/keel-run/coordinator/jobs/job-1/checkpoints/step-1100/model.safetensors')
p=load_file('/tmp/ttq-amx3/peer/checkpoints/step-1100/model.safetensors')
print(len(k),len(p), set(k)^set(p))
for n in sorted(k):
    if n not in p: continue
    a=k[n].float(); b=p[n].float()
    if a.shape!=b.shape: print('SHAPE',n,a.shape,b.shape); continue
    ra=a.pow(2).mean().sqrt().item(); rb=b.pow(2).mean().sqrt().item()
    print(f"{n:70s} rms {ra:.4f} {rb:.4f} ratio {ra/rb:.3f} mean {a.mean().item():+.4f} {b.mean().item():+.4f} max {a.abs().max().item():.3f} {b.abs().max().item():.3f}")
