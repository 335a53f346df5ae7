//! Checks over handler attempts that every record capability promises
//! (operations, named alarms, later fanout deliveries), read from the
//! handlers' [`AttemptFact`]s alone:
//!
//! - no attempt number above the maximum (or below 1) ever ran;
//! - no attempt number of one generation ran twice: the claim commits the
//!   number before the handler runs, so a crash uses it up;
//! - within one process, one record never has two handlers running at once
//!   (across generations too: a named alarm's replacement waits).
//!
//! A power cut in a mode whose [`Allowance`] permits extra runs may take
//! back a claim that was not durable yet: its attempt number then runs
//! again in a later life (a *reclaimed* attempt, not a duplicate). The cut
//! that took it back is the one after the life the number last began in.
//! A record may run more often than its maximum by as many runs as the
//! allowance says (group commit: one per claim a cut took back, that is
//! one per reclaimed attempt); those runs count in `over_attempts_allowed`,
//! any beyond them are over attempts. An attempt *number* beyond the
//! maximum is over attempts in every mode: a lost claim is claimed again
//! with the same number, never a higher one.
//!
//! What remains is a ledger of how each attempt returned, which the
//! workload's checker compares with the stored settlements.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::verdict::{ExtraRuns, Tally, Violation};
use super::workload::{AttemptFact, Outcome};

/// One attempt: object, key, generation, attempt number.
type AttemptKey = (String, String, String, u32);

/// One record's attempts: object, key, generation.
type RecordKey<'a> = (&'a str, &'a str, &'a str);

/// How every journaled attempt returned.
#[derive(Debug, Default)]
pub struct Ledger {
    returned: HashMap<AttemptKey, Outcome>,
}

impl Ledger {
    /// Checks `facts` (in journal order) and keeps their outcomes.
    pub fn check(facts: &[AttemptFact], max_attempts: u32, tally: &mut Tally) -> Ledger {
        let mut ledger = Ledger::default();
        let extra_runs = tally.allowance().extra_runs;
        // Per attempt: the life it last began in.
        let mut began: HashMap<AttemptKey, u32> = HashMap::new();
        // Per record: handler runs begun (repeats included), and the claims
        // of it cuts took back (attempts run again in a later life).
        let mut runs: HashMap<RecordKey<'_>, (u32, u32)> = HashMap::new();
        let mut reclaimed = 0_u64;
        let mut over: HashSet<AttemptKey> = HashSet::new();
        // Per (life, object, key): the attempt whose handler is running.
        let mut running: HashMap<(u32, &str, &str), u32> = HashMap::new();
        let mut outcomes: BTreeMap<&'static str, u64> = BTreeMap::new();
        let mut retries = 0_u64;
        for fact in facts {
            let key: AttemptKey = (
                fact.object.clone(),
                fact.key.clone(),
                fact.generation.clone(),
                fact.attempt,
            );
            if (fact.attempt == 0 || fact.attempt > max_attempts) && over.insert(key.clone()) {
                tally.flag(
                    Violation::OverAttempts,
                    format!(
                        "{} ran attempt {} of generation {} (max {max_attempts})",
                        fact.key, fact.attempt, fact.generation
                    ),
                );
            }
            let slot = (fact.life, fact.object.as_str(), fact.key.as_str());
            match fact.returned {
                None => {
                    let record = (
                        fact.object.as_str(),
                        fact.key.as_str(),
                        fact.generation.as_str(),
                    );
                    let (count, taken_back) = runs.entry(record).or_default();
                    match began.insert(key, fact.life) {
                        None => {}
                        Some(last) if last < fact.life && extra_runs != ExtraRuns::None => {
                            reclaimed += 1;
                            *taken_back += 1;
                        }
                        Some(_) => tally.flag(
                            Violation::Broken("duplicate_attempts"),
                            format!(
                                "{} ran attempt {} of generation {} twice",
                                fact.key, fact.attempt, fact.generation
                            ),
                        ),
                    }
                    *count += 1;
                    check_runs(fact, *count, *taken_back, max_attempts, extra_runs, tally);
                    if let Some(other) = running.insert(slot, fact.attempt) {
                        tally.flag(
                            Violation::Broken("overlapping_handlers"),
                            format!(
                                "{} began attempt {} in life {} while attempt {other} still ran",
                                fact.key, fact.attempt, fact.life
                            ),
                        );
                    }
                    if fact.attempt > 1 {
                        retries += 1;
                    }
                }
                Some(outcome) => {
                    if running.remove(&slot) != Some(fact.attempt) {
                        tally.flag(
                            Violation::Broken("unmatched_returns"),
                            format!(
                                "{} returned attempt {} in life {} without having begun it",
                                fact.key, fact.attempt, fact.life
                            ),
                        );
                    }
                    *outcomes.entry(outcome_name(outcome)).or_default() += 1;
                    ledger.returned.insert(key, outcome);
                }
            }
        }
        let invocations = u64::try_from(began.len()).unwrap_or(u64::MAX);
        let returns = u64::try_from(ledger.returned.len()).unwrap_or(u64::MAX);
        tally.detail("invocations", invocations);
        // Handlers a kill cut off: their attempt stays used up.
        tally.detail(
            "interrupted_invocations",
            invocations.saturating_sub(returns),
        );
        tally.detail("retry_invocations", retries);
        if extra_runs != ExtraRuns::None {
            // Attempt numbers a cut took back and a later life ran again.
            tally.detail("reclaimed_attempts", reclaimed);
        }
        tally.detail(
            "returned",
            serde_json::to_value(&outcomes).unwrap_or_default(),
        );
        ledger
    }

    /// How attempt `attempt` of `generation` of `key` on `object` returned,
    /// if its handler journaled a return.
    pub fn outcome(
        &self,
        object: &str,
        key: &str,
        generation: &str,
        attempt: u32,
    ) -> Option<Outcome> {
        self.returned
            .get(&(
                object.to_owned(),
                key.to_owned(),
                generation.to_owned(),
                attempt,
            ))
            .copied()
    }
}

/// Checks a record's `runs`-th handler run against its maximum and what
/// the allowance adds to it, after cuts took `taken_back` claims of it
/// back.
/// Without an allowance the attempt numbers say it all (a run beyond the
/// maximum has a number beyond it or repeats one).
fn check_runs(
    fact: &AttemptFact,
    runs: u32,
    taken_back: u32,
    max_attempts: u32,
    extra_runs: ExtraRuns,
    tally: &mut Tally,
) {
    let allowed = match extra_runs {
        ExtraRuns::None => return,
        ExtraRuns::Reclaimed => max_attempts.saturating_add(taken_back),
        ExtraRuns::Unbounded => u32::MAX,
    };
    if runs <= max_attempts {
        return;
    }
    let message = format!(
        "{} of generation {} ran {runs} times (max_attempts {max_attempts}; attempt {} in life {}; {taken_back} of its claims taken back by cuts)",
        fact.key, fact.generation, fact.attempt, fact.life
    );
    if runs <= allowed {
        tally.allow_extra_run(message);
    } else {
        tally.flag(Violation::OverAttempts, message);
    }
}

fn outcome_name(outcome: Outcome) -> &'static str {
    match outcome {
        Outcome::Ok => "ok",
        Outcome::Transient => "transient",
        Outcome::Permanent => "permanent",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::torture::verdict::Allowance;

    fn fact(attempt: u32, life: u32, returned: Option<Outcome>) -> AttemptFact {
        AttemptFact {
            returned,
            object: "o".into(),
            key: "op-1".into(),
            generation: "g".into(),
            attempt,
            life,
            scheduled_time: None,
        }
    }

    #[test]
    fn an_attempt_above_the_maximum_is_an_over_attempt() {
        let mut tally = Tally::default();
        let facts = [fact(3, 0, None), fact(3, 0, Some(Outcome::Ok))];
        Ledger::check(&facts, 2, &mut tally);
        assert_eq!(tally.over_attempts, 1);
    }

    #[test]
    fn the_same_attempt_number_running_twice_is_a_duplicate_attempt() {
        let mut tally = Tally::default();
        // Life 0 was killed during attempt 1; life 1 must claim attempt 2.
        let facts = [fact(1, 0, None), fact(1, 1, None)];
        Ledger::check(&facts, 5, &mut tally);
        assert_eq!(tally.broken.get("duplicate_attempts"), Some(&1));
        assert_eq!(tally.violations(), 1);
    }

    #[test]
    fn a_second_handler_of_one_record_in_one_life_is_an_overlap() {
        let mut tally = Tally::default();
        let facts = [fact(1, 0, None), fact(2, 0, None)];
        Ledger::check(&facts, 5, &mut tally);
        assert_eq!(tally.broken.get("overlapping_handlers"), Some(&1));
    }

    fn power_cut_tally(extra_runs: ExtraRuns) -> Tally {
        Tally::allowing(Allowance {
            extra_runs,
            ..Allowance::default()
        })
    }

    #[test]
    fn an_attempt_a_cut_took_back_may_run_again_in_a_later_life() {
        let mut tally = power_cut_tally(ExtraRuns::Reclaimed);
        let t = Some(Outcome::Transient);
        let facts = [
            fact(1, 0, None),
            fact(1, 0, t),
            fact(1, 1, None),
            fact(1, 1, t),
            fact(2, 1, None),
        ];
        Ledger::check(&facts, 5, &mut tally);
        assert_eq!(tally.violations(), 0, "{:?}", tally.examples());
        assert_eq!(tally.detail.get("reclaimed_attempts"), Some(&1.into()));
    }

    #[test]
    fn group_commit_allows_one_run_beyond_max_attempts_per_claim_a_cut_took_back() {
        // Attempt 2 (the last) was claimed, ran, and its claim was lost.
        let t = Some(Outcome::Transient);
        let once_more = [
            fact(1, 0, None),
            fact(1, 0, t),
            fact(2, 0, None),
            fact(2, 1, None),
        ];
        let mut tally = power_cut_tally(ExtraRuns::Reclaimed);
        Ledger::check(&once_more, 2, &mut tally);
        assert_eq!(tally.violations(), 0, "{:?}", tally.examples());
        assert_eq!(tally.over_attempts_allowed, 1);

        // A second cut (after life 1) took attempt 2's claim back again.
        let twice_more = [once_more.as_slice(), &[fact(2, 2, None)]].concat();
        let mut tally = power_cut_tally(ExtraRuns::Reclaimed);
        Ledger::check(&twice_more, 2, &mut tally);
        assert_eq!(tally.violations(), 0, "{:?}", tally.examples());
        assert_eq!(tally.over_attempts_allowed, 2);

        // One cut may take back two claims (both within its flush
        // window): attempts 1 and 2 of life 0 both run again.
        let t = Some(Outcome::Transient);
        let one_cut_two_runs = [
            fact(1, 0, None),
            fact(1, 0, t),
            fact(2, 0, None),
            fact(2, 0, t),
            fact(1, 1, None),
            fact(1, 1, t),
            fact(2, 1, None),
            fact(2, 1, t),
        ];
        let mut tally = power_cut_tally(ExtraRuns::Reclaimed);
        Ledger::check(&one_cut_two_runs, 2, &mut tally);
        assert_eq!((tally.over_attempts_allowed, tally.over_attempts), (2, 0));
        assert_eq!(tally.violations(), 0, "{:?}", tally.examples());
    }

    #[test]
    fn an_attempt_number_beyond_the_maximum_is_over_attempts_even_across_cuts() {
        // A lost claim is claimed again with the same number: a higher one
        // means the maximum was not checked against what was durable.
        let mut tally = power_cut_tally(ExtraRuns::Reclaimed);
        let t = Some(Outcome::Transient);
        let facts = [
            fact(1, 0, None),
            fact(1, 0, t),
            fact(2, 0, None),
            fact(2, 0, t),
            fact(3, 1, None),
        ];
        Ledger::check(&facts, 2, &mut tally);
        assert!(tally.over_attempts >= 1, "{:?}", tally.examples());
    }

    #[test]
    fn without_an_allowance_a_repeat_in_a_later_life_is_a_duplicate() {
        let mut tally = Tally::default();
        let facts = [fact(2, 0, None), fact(2, 1, None)];
        Ledger::check(&facts, 2, &mut tally);
        assert_eq!(tally.broken.get("duplicate_attempts"), Some(&1));
        assert_eq!(tally.over_attempts_allowed, 0);
    }

    #[test]
    fn retries_across_kills_within_the_maximum_are_clean() {
        let mut tally = Tally::default();
        let facts = [
            fact(1, 0, None),
            fact(2, 1, None),
            fact(2, 1, Some(Outcome::Transient)),
            fact(3, 1, None),
            fact(3, 1, Some(Outcome::Ok)),
        ];
        let ledger = Ledger::check(&facts, 3, &mut tally);
        assert_eq!(tally.violations(), 0);
        assert_eq!(ledger.outcome("o", "op-1", "g", 3), Some(Outcome::Ok));
        assert_eq!(ledger.outcome("o", "op-1", "g", 1), None);
    }
}
