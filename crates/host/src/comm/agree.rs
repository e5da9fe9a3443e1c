//! Agreement of a collective plan across ranks: every rank describes the plan it is about to
//! build ([`PlanDesc`]: operation, shapes, dtypes, options, heap offsets, grid, and whether its
//! own checks passed), the descriptions go through the job's store once
//! ([`mkernel_bootstrap::Store::all_gather`], name `mkernel/agree/<sequence>`, the
//! communicator's bootstrap timeout), and every rank compares all of them with the same pure
//! function ([`compare`]). So every rank returns the same answer: the plan goes ahead, or
//! [`Error::PlanFailed`] (some rank's own checks failed; the error names the ranks and their
//! reasons) or [`Error::PlanMismatch`] (the field that differs, and which ranks hold which
//! value). A rank that never comes makes the others fail with the store's timeout naming it.
//!
//! The sequence number is the communicator's (one per communicator, advanced by every plan on
//! every rank whatever the outcome), so a plan that failed on one rank does not shift the
//! names of later exchanges.
use crate::error::{Error, Result};
use mkernel_bootstrap::Store;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::time::Duration;

/// How ranks' values of one field must relate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rule {
    /// The same on every rank.
    Equal,
    /// May differ; [`Agreed::min`] gives the smallest (e.g. SM counts).
    Min,
}

/// One rank's description of the plan it builds: named fields in a fixed order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanDesc {
    op: &'static str,
    fields: Vec<(&'static str, String, Rule)>,
}

impl PlanDesc {
    /// A description of operation `op` (compared first: ranks building different plans fail
    /// on `op`).
    pub fn new(op: &'static str) -> PlanDesc {
        PlanDesc { op, fields: vec![] }
    }
    /// A field that must be equal on every rank.
    pub fn field(mut self, name: &'static str, value: impl std::fmt::Display) -> PlanDesc {
        self.fields.push((name, value.to_string(), Rule::Equal));
        self
    }
    /// A number that may differ between ranks; the plan uses the smallest ([`Agreed::min`]).
    pub fn min_field(mut self, name: &'static str, value: u64) -> PlanDesc {
        self.fields.push((name, value.to_string(), Rule::Min));
        self
    }
    /// The operation.
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// The text sent through the store: `op`, then `error` (empty when the rank's checks
    /// passed), then one line per field, `=` (equal) or `~` (min) between name and value.
    /// Newlines in values become spaces.
    fn encode(&self, error: Option<&str>) -> Vec<u8> {
        let clean = |s: &str| s.replace(['\n', '\r'], " ");
        let mut s = format!("op={}\nerror={}\n", self.op, error.map(clean).unwrap_or_default());
        for (name, value, rule) in &self.fields {
            let sep = if *rule == Rule::Min { '~' } else { '=' };
            let _ = writeln!(s, "{name}{sep}{}", clean(value));
        }
        s.into_bytes()
    }
}

/// A rank's description as received.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Received {
    /// (name, value, rule) in the sender's order; `op` and `error` included.
    fields: Vec<(String, String, Rule)>,
}

impl Received {
    fn decode(bytes: &[u8]) -> Received {
        let text = String::from_utf8_lossy(bytes);
        let fields = text
            .lines()
            .filter_map(|line| {
                let i = line.find(['=', '~'])?;
                let rule = if line.as_bytes()[i] == b'~' {
                    Rule::Min
                } else {
                    Rule::Equal
                };
                Some((line[..i].to_string(), line[i + 1..].to_string(), rule))
            })
            .collect();
        Received { fields }
    }
    fn get(&self, name: &str) -> Option<&(String, String, Rule)> {
        self.fields.iter().find(|(n, _, _)| n == name)
    }
}

/// What the ranks agreed on.
#[derive(Clone, Debug, Default)]
pub struct Agreed {
    mins: BTreeMap<String, u64>,
}

impl Agreed {
    /// The smallest value of a [`PlanDesc::min_field`] over the ranks.
    pub fn min(&self, name: &str) -> Option<u64> {
        self.mins.get(name).copied()
    }
}

/// "ranks 0, 2" / "rank 1".
fn ranks_text(ranks: &[usize]) -> String {
    let list = ranks.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ");
    if ranks.len() == 1 {
        format!("rank {list}")
    } else {
        format!("ranks {list}")
    }
}

/// Compares every rank's description (index = rank): the same result on every rank for the
/// same input. Order: ranks whose own checks failed ([`Error::PlanFailed`]), then `op`, then
/// every field in the order of the first rank that has it ([`Error::PlanMismatch`]).
pub(crate) fn compare(op: &'static str, all: &[Received]) -> Result<Agreed> {
    let failed: Vec<(usize, &str)> = all
        .iter()
        .enumerate()
        .filter_map(|(r, d)| match d.get("error") {
            Some((_, e, _)) if !e.is_empty() => Some((r, e.as_str())),
            None => Some((r, "sent no description")),
            _ => None,
        })
        .collect();
    if !failed.is_empty() {
        // Ranks with the same reason together, reasons in order of their first rank.
        let mut groups: Vec<(&str, Vec<usize>)> = vec![];
        for &(r, e) in &failed {
            match groups.iter_mut().find(|(g, _)| *g == e) {
                Some((_, rs)) => rs.push(r),
                None => groups.push((e, vec![r])),
            }
        }
        let reason = groups
            .iter()
            .map(|(e, rs)| format!("{}: {e}", ranks_text(rs)))
            .collect::<Vec<_>>()
            .join("; ");
        return Err(Error::PlanFailed {
            op,
            ranks: failed.iter().map(|&(r, _)| r).collect(),
            reason,
        });
    }
    // Field names in first-seen order, `op` first.
    let mut names: Vec<&str> = vec!["op"];
    for d in all {
        for (n, _, _) in &d.fields {
            if n != "error" && !names.contains(&n.as_str()) {
                names.push(n);
            }
        }
    }
    let mut agreed = Agreed::default();
    for name in names {
        let values: Vec<Option<&(String, String, Rule)>> = all.iter().map(|d| d.get(name)).collect();
        let all_min = values.iter().all(|v| matches!(v, Some((_, _, Rule::Min))));
        if all_min {
            let nums: Option<Vec<u64>> = values.iter().map(|v| v.and_then(|(_, x, _)| x.parse().ok())).collect();
            if let Some(min) = nums.and_then(|n| n.into_iter().min()) {
                agreed.mins.insert(name.to_string(), min);
                continue;
            }
        }
        let shown = |v: &Option<&(String, String, Rule)>| match v {
            Some((_, x, _)) => x.clone(),
            None => "(absent)".to_string(),
        };
        let mut groups: Vec<(String, Vec<usize>)> = vec![];
        for (r, v) in values.iter().enumerate() {
            let x = shown(v);
            match groups.iter_mut().find(|(g, _)| *g == x) {
                Some((_, rs)) => rs.push(r),
                None => groups.push((x, vec![r])),
            }
        }
        if groups.len() > 1 {
            let values = groups
                .iter()
                .map(|(x, rs)| format!("{} {x}", ranks_text(rs)))
                .collect::<Vec<_>>()
                .join("; ");
            return Err(Error::PlanMismatch {
                op,
                field: name.to_string(),
                values,
            });
        }
    }
    Ok(agreed)
}

/// Exchanges `desc` (and this rank's own outcome so far, `local`) with every rank of `store`'s
/// job under the name `mkernel/agree/<seq>` and compares them ([`compare`]). `Ok` on every
/// rank, or the same error on every rank; a rank that does not come within `timeout` makes the
/// others fail with the store's timeout naming it.
pub(crate) fn exchange(
    store: &Store,
    seq: u64,
    desc: &PlanDesc,
    local: Option<&Error>,
    timeout: Duration,
) -> Result<Agreed> {
    let local_text = local.map(|e| e.to_string());
    let mine = desc.encode(local_text.as_deref());
    let all = store.all_gather(&format!("mkernel/agree/{seq}"), &mine, timeout)?;
    let received: Vec<Received> = all.iter().map(|b| Received::decode(b)).collect();
    compare(desc.op, &received)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mkernel_bootstrap::{JobKey, StoreServer};
    use std::net::TcpListener;

    fn moe(tokens: usize, sms: u64) -> PlanDesc {
        PlanDesc::new("moe_ep")
            .field("tokens", tokens)
            .field("hidden", 4096)
            .field("dtype", "bf16")
            .field("heap offsets", "[65536, 131072]")
            .min_field("sm_count", sms)
    }
    fn rx(d: &PlanDesc, err: Option<&str>) -> Received {
        Received::decode(&d.encode(err))
    }

    #[test]
    fn equal_descriptions_agree_and_min_fields_take_the_smallest() {
        let all = [rx(&moe(64, 132), None), rx(&moe(64, 66), None), rx(&moe(64, 100), None)];
        let a = compare("moe_ep", &all).unwrap();
        assert_eq!(a.min("sm_count"), Some(66));
        assert_eq!(a.min("tokens"), None);
    }

    #[test]
    fn a_differing_field_is_named_with_the_ranks_that_hold_each_value() {
        let all = [
            rx(&moe(64, 132), None),
            rx(&moe(4096, 132), None),
            rx(&moe(64, 132), None),
        ];
        match compare("moe_ep", &all).unwrap_err() {
            Error::PlanMismatch { field, values, .. } => {
                assert_eq!(field, "tokens");
                assert_eq!(values, "ranks 0, 2 64; rank 1 4096");
            }
            e => panic!("{e}"),
        }
    }

    #[test]
    fn the_first_differing_field_in_order_is_reported_and_op_comes_first() {
        let other = PlanDesc::new("ring attention").field("tokens", 1);
        let all = [rx(&moe(64, 132), None), rx(&other, None)];
        let e = compare("moe_ep", &all).unwrap_err();
        assert!(matches!(&e, Error::PlanMismatch { field, .. } if field == "op"), "{e}");
        // A field one rank lacks is a mismatch on that field.
        let fewer = PlanDesc::new("moe_ep").field("tokens", 64);
        let e = compare("moe_ep", &[rx(&moe(64, 1), None), rx(&fewer, None)]).unwrap_err();
        assert!(
            matches!(&e, Error::PlanMismatch { field, values, .. } if field == "hidden" && values.contains("(absent)")),
            "{e}"
        );
    }

    #[test]
    fn a_rank_whose_checks_failed_fails_every_rank_with_its_reason() {
        let all = [
            rx(&moe(64, 132), None),
            rx(&moe(64, 132), Some("W_up holds 3 elements\nbut needs 4")),
            rx(&moe(9, 132), Some("W_up holds 3 elements\nbut needs 4")),
        ];
        match compare("moe_ep", &all).unwrap_err() {
            Error::PlanFailed { ranks, reason, .. } => {
                assert_eq!(ranks, [1, 2]);
                assert_eq!(reason, "ranks 1, 2: W_up holds 3 elements but needs 4");
            }
            e => panic!("{e}"),
        }
        // Garbage (no fields at all) counts as a failed rank, not as a panic.
        let e = compare("moe_ep", &[rx(&moe(1, 1), None), Received::decode(b"\xff\xfe")]).unwrap_err();
        assert!(matches!(e, Error::PlanFailed { ref ranks, .. } if ranks == &[1]), "{e}");
    }

    #[test]
    fn values_with_separators_survive_the_encoding() {
        let d = PlanDesc::new("x").field("a=b", "c~d=e").min_field("n", 7);
        let r = rx(&d, None);
        assert_eq!(r.get("a").map(|f| f.1.as_str()), Some("b=c~d=e"));
        assert_eq!(r.get("n").map(|f| (f.1.as_str(), f.2)), Some(("7", Rule::Min)));
    }

    /// Several ranks, each with its own store handle on one in-process store, exchange
    /// through the real protocol: every rank gets the same answer.
    fn run_ranks(descs: Vec<(PlanDesc, Option<Error>)>, timeout: Duration) -> Vec<Result<Agreed>> {
        let key = JobKey::new("a key of 16+ bytes for the agreement test").unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let world = descs.len();
        let server = StoreServer::serve(listener, world, key.clone()).unwrap();
        let rank0 = Store::host(server, Duration::from_secs(10)).unwrap();
        let mut stores = vec![rank0];
        for r in 1..world {
            stores.push(Store::connect(&addr, r, world, &key, Duration::from_secs(10)).unwrap());
        }
        let results: Vec<Result<Agreed>> = std::thread::scope(|s| {
            let handles: Vec<_> = stores
                .iter()
                .zip(&descs)
                .map(|(store, (d, e))| s.spawn(move || exchange(store, 0, d, e.as_ref(), timeout)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // Rank 0 hosts the server: drop it last.
        while stores.len() > 1 {
            stores.pop();
        }
        results
    }

    #[test]
    fn ranks_exchange_through_the_store_and_all_get_the_same_answer() {
        let ok = run_ranks(vec![(moe(64, 132), None), (moe(64, 66), None)], Duration::from_secs(10));
        for r in &ok {
            assert_eq!(r.as_ref().unwrap().min("sm_count"), Some(66));
        }
        let bad = run_ranks(
            vec![(moe(64, 132), None), (moe(4096, 132), None), (moe(64, 132), None)],
            Duration::from_secs(10),
        );
        let texts: Vec<String> = bad.iter().map(|r| r.as_ref().unwrap_err().to_string()).collect();
        assert!(
            texts[0].contains("tokens") && texts[0].contains("rank 1 4096"),
            "{}",
            texts[0]
        );
        assert!(texts.iter().all(|t| *t == texts[0]), "{texts:?}");
        let failed = run_ranks(
            vec![
                (
                    moe(64, 132),
                    Some(Error::Shape {
                        op: "moe_ep",
                        reason: "bad".into(),
                    }),
                ),
                (moe(64, 132), None),
            ],
            Duration::from_secs(10),
        );
        let texts: Vec<String> = failed.iter().map(|r| r.as_ref().unwrap_err().to_string()).collect();
        assert!(
            texts[0].contains("rank 0: invalid shape for moe_ep: bad"),
            "{}",
            texts[0]
        );
        assert_eq!(texts[0], texts[1]);
    }
}
