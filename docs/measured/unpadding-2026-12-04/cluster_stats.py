import json,sys,statistics as st
for d in sys.argv[1:]:
    steps=[json.loads(l) for l in open(d+'/metrics.jsonl') if '"step_seconds"' in l]
    ss=[s['step_seconds'] for s in steps if s['step']>20]
    ar=[s.get('allreduce_seconds',0) for s in steps if s['step']>20]
    ev=[json.loads(l) for l in open(d+'/metrics.jsonl') if 'eval_loss' in l]
    last=ev[-1] if ev else {}
    print(d, len(steps), 'median step %.4f mean %.4f ring %.4f'%(st.median(ss), st.mean(ss), st.median(ar)), {k:v for k,v in last.items() if k in ('eval_loss','eval_accuracy','step')})
