use super::*;
use crate::metrics::{EvalLine, ResumeEvent, StepLine};
use std::time::{Duration, UNIX_EPOCH};

/// Two records as TensorBoard 2.21's own `RecordWriter` wrote them: the `file_version` event
/// at wall time 1.5, then `train/loss` = 3.25 at step 7, wall time 2.0.
const TENSORBOARD_BYTES: &str = "1800000000000000a37f4b2209000000000000f83f1a0d627261696e2e4576656e743a322a28646c200000000000000029eda95009000000000000004010072a130a110a0a747261696e2f6c6f737315000050404cd9b19e";

/// The event of one scalar `t` = 0.0 as TensorBoard 2.21's protobuf serializes it.
const ZERO_SCALAR_EVENT: &str = "2a0a0a080a01741500000000";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn a_zero_scalar_is_encoded_as_tensorboard_encodes_it() {
    // Python: Event(summary=Summary(value=[Summary.Value(tag="t", simple_value=0.0)])).
    let bytes = Event::scalars(0.0, 0, [("t", 0.0)]).encode_to_vec();
    assert_eq!(hex(&bytes), ZERO_SCALAR_EVENT);
}

#[test]
fn records_match_tensorboards_own_writer() {
    let mut out = Vec::new();
    record::frame_record(&Event::file_version(1.5).encode_to_vec(), &mut out);
    record::frame_record(
        &Event::scalars(2.0, 7, [("train/loss", 3.25)]).encode_to_vec(),
        &mut out,
    );
    assert_eq!(hex(&out), TENSORBOARD_BYTES);
}

fn step_line(step: u64, loss: f64) -> MetricsLine {
    MetricsLine::Step(StepLine {
        allreduce_seconds: 0.01,
        grad_norm: 1.5,
        loss,
        lr: 1e-4,
        mlm_accuracy: 0.25,
        mlm_loss: loss,
        nsp_loss: 0.0,
        skipped: false,
        step,
        step_seconds: 0.5,
        tokens: 1024,
        tokens_per_s: 2048.0,
        phase: 0,
    })
}

#[test]
fn a_file_holds_its_version_then_every_line_and_restarts_never_reuse_it() {
    let dir = tempfile::tempdir().unwrap();
    let now = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let file = EventFile::create(dir.path(), now, "node a/1").unwrap();
    assert_eq!(
        file.path().file_name().unwrap(),
        "events.out.tfevents.1700000000.node_a_1"
    );
    let lines = [
        step_line(1, 7.0),
        MetricsLine::Eval(EvalLine {
            eval_accuracy: 0.5,
            eval_loss: 6.0,
            eval_masked_tokens: 10,
            eval_perplexity: 403.4,
            step: 1,
        }),
        MetricsLine::Event(EventLine::Resume(ResumeEvent {
            generation: 2,
            source: "checkpoint".into(),
            step: 1,
            world_size: 2,
        })),
    ];
    for line in &lines {
        file.append(&events_of(line, now), true).unwrap();
    }
    let bytes = std::fs::read(file.path()).unwrap();
    let events: Vec<Event> = record::read_records(&bytes)
        .unwrap()
        .into_iter()
        .map(|r| Event::decode(r).unwrap())
        .collect();
    assert_eq!(events.len(), 4);
    assert_eq!(
        events[0].what,
        Some(event::What::FileVersion("brain.Event:2".into()))
    );
    let Some(event::What::Summary(train)) = &events[1].what else {
        panic!("not a summary: {:?}", events[1]);
    };
    assert_eq!(events[1].step, 1);
    assert_eq!(train.value.len(), 9);
    assert_eq!(train.value[0].tag, "train/loss");
    assert_eq!(train.value[0].simple_value, Some(7.0));
    // A zero is written (train/nsp_loss without NSP), not left out as a proto3 default.
    assert_eq!(train.value[2].tag, "train/nsp_loss");
    assert_eq!(train.value[2].simple_value, Some(0.0));
    let Some(event::What::Summary(eval)) = &events[2].what else {
        panic!("not a summary: {:?}", events[2]);
    };
    let tags: Vec<&str> = eval.value.iter().map(|v| v.tag.as_str()).collect();
    assert_eq!(tags, ["eval/loss", "eval/accuracy", "eval/perplexity"]);
    assert_eq!(events[3], Event::restart(1_700_000_000.0, 2));

    // A restart in the same second: a new file, the old one untouched.
    let again = EventFile::create(dir.path(), now, "node a/1").unwrap();
    assert_ne!(again.path(), file.path());
    assert_eq!(std::fs::read(file.path()).unwrap(), bytes);
    let names: Vec<String> = event_files(dir.path())
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(
        names,
        [
            "events.out.tfevents.1700000000.node_a_1",
            "events.out.tfevents.1700000000.node_a_1.1"
        ]
    );
    assert!(event_files(&dir.path().join("missing")).unwrap().is_empty());
}

#[test]
fn hosts_become_plain_names() {
    assert_eq!(plain_host(""), "localhost");
    assert_eq!(plain_host(".."), "localhost");
    assert_eq!(plain_host("gpu-01.example.org\n"), "gpu-01.example.org");
    assert!(
        crate::checkpoint::check_plain_name(&format!(
            "{EVENT_FILE_PREFIX}1.{}",
            plain_host("../x")
        ))
        .is_ok()
    );
}
