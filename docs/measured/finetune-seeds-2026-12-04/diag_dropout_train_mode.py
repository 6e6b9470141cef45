import json, torch
from transformers import BertForMaskedLM
torch.set_num_threads(2)
d=json.load(open('/tmp/ttq-amx3/heldout-masked.json'))['sequences'][:2000]
ck={'keel':'/tmp/ttq-amx3/keel-run/coordinator/jobs/job-1/checkpoints/step-1100','peer':'/tmp/ttq-amx3/peer/checkpoints/step-1100'}
def ev(model, train, seed=0):
    torch.manual_seed(seed); model.train(train); tot=0; n=0
    for i in range(0,len(d),64):
        ch=d[i:i+64]; w=max(len(r['input_ids']) for r in ch)
        ids=torch.zeros(len(ch),w,dtype=torch.long); at=torch.zeros(len(ch),w,dtype=torch.long); rows=[];cols=[];lab=[]
        for j,r in enumerate(ch):
            ids[j,:len(r['input_ids'])]=torch.tensor(r['input_ids']); at[j,:len(r['input_ids'])]=1
            rows+= [j]*len(r['positions']); cols+=r['positions']; lab+=r['labels']
        with torch.no_grad(): lg=model(input_ids=ids,attention_mask=at).logits[rows,cols]
        tot+=torch.nn.functional.cross_entropy(lg,torch.tensor(lab),reduction='sum').item(); n+=len(lab)
    return tot/n
for k,p in ck.items():
    m=BertForMaskedLM.from_pretrained(p)
    e=ev(m,False); t=[ev(m,True,s) for s in range(3)]
    print(k,'eval',round(e,4),'train-mode',[round(x,4) for x in t], flush=True)
