//! A job's slots as a plain state machine: which need a worker, which run which job, which
//! are done, and when a slot has failed too often. [`run`](crate::run) feeds it what happens
//! and carries out what it returns; it knows nothing of networks or leases.
//!
//! Each worker's share of a job is a *slot*: slots `0..trainers` run the job's executor, and a
//! DiLoCo job has one more, the parameter server's, and with `standby` one after it, the
//! standby server's. A slot moves through
//!
//! ```text
//! Wanted ──allocation starts──▶ Allocating ──leased──▶ Running(job) ──exit 0──▶ Done
//!    ▲                              │                      │
//!    └────── allocation failed ─────┘◀── failed, lost ─────┘ (while attempts are left)
//! ```
//!
//! A resumed run starts the slots its earlier run held a lease for in `Adopting`: they go to
//! `Running` under the lease taken over, or, when it is gone, back to `Wanted`. A slot that
//! wants no worker any more (its trainer benched, its attempts spent in an elastic run, or
//! the run's work over) is `GivenUp`.
//!
//! One allocation is in flight at a time, for the wanted slots of one role, the parameter
//! server's first, the standby's last: so no worker is leased for two slots of a run, and a
//! replacement never races another allocation for the same worker. The standby is optional:
//! training neither waits for one nor fails without one, and a standby slot that failed its
//! attempts is given up. When the server is lost its standby's job moves into the server's
//! slot ([`promote`](Slots::promote)) and the standby's slot wants a worker again.
//!
//! **Elastic runs.** With trainers `{ min, max }` there are `max` trainer slots. While fewer
//! than `min` run (or finished), an allocation must find the missing ones (the run fails
//! when it cannot); beyond that, an allocation is *optional*: it takes whoever answers one
//! advertisement, and finding nobody is no failure. Once the run's work is over it is
//! [`close`](Slots::close)d: no more workers are wanted.

/// What a slot's worker runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Trainer,
    ParameterServer,
    Standby,
}

/// Where a slot stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotState {
    /// Needs a worker.
    Wanted,
    /// An allocation is finding it one.
    Allocating,
    /// A restarted scheduler is taking over the lease an earlier run of it held for the slot.
    Adopting,
    /// Job `job` was dispatched for it (or is being dispatched).
    Running { job: String },
    /// Its job finished successfully.
    Done,
    /// It wants no worker any more.
    GivenUp,
}

/// What the run must do after a slot's job ended or its worker was lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The slot is done.
    Done,
    /// The slot wants another worker.
    Replace,
    /// The slot had its attempts: the run fails.
    Exhausted { slot: usize, attempts: u32 },
    /// The slot had its attempts, but the run has the trainers it needs without it: the slot
    /// is given up.
    GivenUp { slot: usize, attempts: u32 },
    /// Not a job of this run (any more): nothing to do.
    Unknown,
}

#[derive(Debug, Clone)]
struct Slot {
    role: Role,
    state: SlotState,
    /// Jobs started for the slot.
    attempts: u32,
}

/// An allocation to start: leases for `slots`, of `role`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    pub role: Role,
    pub slots: Vec<usize>,
    /// The fewest it must lease: finding fewer fails the run. 0: optional, whoever answers
    /// one advertisement.
    pub at_least: usize,
}

/// The slots of one job.
#[derive(Debug, Clone)]
pub struct Slots {
    slots: Vec<Slot>,
    /// The trainers the run needs: fewer running (or finished) must be found.
    min_trainers: usize,
    max_attempts: u32,
    allocating: bool,
}

impl Slots {
    /// `max_trainers` executor slots, of which `min_trainers` are needed, then the parameter
    /// server's when `server`, then the standby's when `standby` too; each may start at most
    /// `max_attempts` jobs.
    pub fn new(
        (min_trainers, max_trainers): (usize, usize),
        (server, standby): (bool, bool),
        max_attempts: u32,
    ) -> Self {
        let mut slots = vec![
            Slot {
                role: Role::Trainer,
                state: SlotState::Wanted,
                attempts: 0,
            };
            max_trainers
        ];
        let servers = [
            (server, Role::ParameterServer),
            (server && standby, Role::Standby),
        ];
        for role in servers
            .into_iter()
            .filter_map(|(wanted, role)| wanted.then_some(role))
        {
            slots.push(Slot {
                role,
                state: SlotState::Wanted,
                attempts: 0,
            });
        }
        Self {
            slots,
            min_trainers: min_trainers.min(max_trainers),
            max_attempts,
            allocating: false,
        }
    }

    pub fn role(&self, slot: usize) -> Role {
        self.slots.get(slot).map_or(Role::Trainer, |s| s.role)
    }

    pub fn state(&self, slot: usize) -> Option<&SlotState> {
        self.slots.get(slot).map(|s| &s.state)
    }

    pub fn attempts(&self, slot: usize) -> u32 {
        self.slots.get(slot).map_or(0, |s| s.attempts)
    }

    /// The next allocation to start, when none is in flight and slots are wanted: the wanted
    /// slots of one role, the parameter server's first, the standby's last; an optional one
    /// only when `optional`. They become `Allocating`.
    pub fn next_allocation(&mut self, optional: bool) -> Option<Allocation> {
        if self.allocating {
            return None;
        }
        let wanted = |role| {
            let slots: Vec<usize> = self.wanted(role).collect();
            let at_least = match role {
                Role::ParameterServer => slots.len(),
                Role::Trainer => self
                    .min_trainers
                    .saturating_sub(self.trainers_in_run())
                    .min(slots.len()),
                Role::Standby => 0,
            };
            (role, slots, at_least)
        };
        // Needed ones first; of the optional ones the standby before more trainers, which an
        // elastic run below its `max` would otherwise advertise for ahead of it forever.
        let (role, slots, at_least) = [
            wanted(Role::ParameterServer),
            wanted(Role::Trainer),
            wanted(Role::Standby),
        ]
        .into_iter()
        .filter(|(_, slots, _)| !slots.is_empty())
        .min_by_key(|(role, _, at_least)| (*at_least == 0, *role == Role::Trainer))
        .filter(|(_, _, at_least)| *at_least > 0 || optional)?;
        for slot in &slots {
            self.slots[*slot].state = SlotState::Allocating;
        }
        self.allocating = true;
        Some(Allocation {
            role,
            slots,
            at_least,
        })
    }

    /// Trainer slots running a job, being taken over, or done with their share.
    fn trainers_in_run(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| {
                s.role == Role::Trainer
                    && matches!(
                        s.state,
                        SlotState::Running { .. } | SlotState::Adopting | SlotState::Done
                    )
            })
            .count()
    }

    /// The run's work is over: no slot wants a worker any more, and an allocation in flight
    /// finds none for its slots (their leases go back).
    pub fn close(&mut self) {
        for slot in &mut self.slots {
            if matches!(slot.state, SlotState::Wanted | SlotState::Allocating) {
                slot.state = SlotState::GivenUp;
            }
        }
    }

    /// Whether an allocation that found a worker for `slot` may dispatch to it.
    pub fn allocating(&self, slot: usize) -> bool {
        self.state(slot) == Some(&SlotState::Allocating)
    }

    fn wanted(&self, role: Role) -> impl Iterator<Item = usize> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter(move |(_, s)| s.role == role && s.state == SlotState::Wanted)
            .map(|(slot, _)| slot)
    }

    /// The allocation in flight ended; slots it found no worker for are wanted again.
    pub fn allocation_ended(&mut self) {
        self.allocating = false;
        for slot in &mut self.slots {
            if slot.state == SlotState::Allocating {
                slot.state = SlotState::Wanted;
            }
        }
    }

    /// `slot` waits for a lease of an earlier run to be taken over: no allocation is started
    /// for it meanwhile.
    pub fn adopting(&mut self, slot: usize) {
        if let Some(s) = self.slots.get_mut(slot)
            && s.state == SlotState::Wanted
        {
            s.state = SlotState::Adopting;
        }
    }

    /// The lease of an earlier run could not be taken over: the slot wants a worker.
    pub fn adoption_failed(&mut self, slot: usize) {
        if let Some(s) = self.slots.get_mut(slot)
            && s.state == SlotState::Adopting
        {
            s.state = SlotState::Wanted;
        }
    }

    /// Job `job` is being dispatched for `slot`: one more attempt.
    pub fn started(&mut self, slot: usize, job: &str) {
        if let Some(s) = self.slots.get_mut(slot) {
            s.attempts += 1;
            s.state = SlotState::Running {
                job: job.to_string(),
            };
        }
    }

    /// The slot running `job`, if any.
    pub fn slot_of(&self, job: &str) -> Option<usize> {
        self.slots
            .iter()
            .position(|s| matches!(&s.state, SlotState::Running { job: j } if j == job))
    }

    /// `slot` is given up: it wants no worker (its trainer was benched).
    pub fn give_up(&mut self, slot: usize) {
        if let Some(s) = self.slots.get_mut(slot) {
            s.state = SlotState::GivenUp;
        }
    }

    /// Job `job` finished successfully.
    pub fn finished(&mut self, job: &str) -> Verdict {
        let Some(slot) = self.slot_of(job) else {
            return Verdict::Unknown;
        };
        self.slots[slot].state = SlotState::Done;
        Verdict::Done
    }

    /// Job `job` failed or its worker was lost (a dispatch that failed counts too): its slot
    /// wants a new worker while it has attempts left. A job that `progressed` (it did some of
    /// the work) gives its slot its attempts back: they are for jobs that cannot run at all.
    pub fn failed(&mut self, job: &str, progressed: bool) -> Verdict {
        let Some(slot) = self.slot_of(job) else {
            return Verdict::Unknown;
        };
        if progressed {
            self.slots[slot].attempts = 0;
        }
        let attempts = self.slots[slot].attempts;
        if attempts >= self.max_attempts {
            self.slots[slot].state = SlotState::GivenUp;
            let spare = match self.slots[slot].role {
                Role::Trainer => self.trainers_in_run() >= self.min_trainers,
                Role::Standby => true,
                Role::ParameterServer => false,
            };
            return match spare {
                true => Verdict::GivenUp { slot, attempts },
                false => Verdict::Exhausted { slot, attempts },
            };
        }
        self.slots[slot].state = SlotState::Wanted;
        Verdict::Replace
    }

    /// The server's job `server` failed and the standby's job takes its place: the standby's
    /// job moves into the server's slot (one more attempt of it), and the standby's slot
    /// wants a worker. False, with nothing changed, unless both run.
    pub fn promote(&mut self, server: &str, standby: &str) -> bool {
        let (Some(to), Some(from)) = (self.slot_of(server), self.slot_of(standby)) else {
            return false;
        };
        if self.slots[to].role != Role::ParameterServer || self.slots[from].role != Role::Standby {
            return false;
        }
        self.slots[to].state = SlotState::Running {
            job: standby.to_string(),
        };
        self.slots[to].attempts += 1;
        // Its job did not fail: the slot starts over.
        self.slots[from].attempts = 0;
        self.slots[from].state = SlotState::Wanted;
        true
    }

    /// The slot of `role` (the first), if the job has one.
    pub fn of_role(&self, role: Role) -> Option<usize> {
        self.slots.iter().position(|s| s.role == role)
    }

    /// The slots of `role`.
    pub fn count(&self, role: Role) -> usize {
        self.slots.iter().filter(|s| s.role == role).count()
    }

    /// The slots of `role` whose job finished successfully.
    pub fn done(&self, role: Role) -> usize {
        self.slots
            .iter()
            .filter(|s| s.role == role && s.state == SlotState::Done)
            .count()
    }

    /// Every slot is done or given up.
    pub fn complete(&self) -> bool {
        self.slots
            .iter()
            .all(|s| matches!(s.state, SlotState::Done | SlotState::GivenUp))
    }

    /// The jobs running now, with their slots.
    pub fn running(&self) -> impl Iterator<Item = (usize, &str)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(slot, s)| match &s.state {
                SlotState::Running { job } => Some((slot, job.as_str())),
                _ => None,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The next allocation, optional ones too: its role and slots.
    fn next(slots: &mut Slots) -> Option<(Role, Vec<usize>)> {
        slots.next_allocation(true).map(|a| (a.role, a.slots))
    }

    /// An elastic run's allocations must find `min` trainers; beyond, they are optional, and
    /// are started only when the run allows; a slot whose attempts are spent is given up
    /// while the run has `min` without it; a closed run wants nobody.
    #[test]
    fn an_elastic_run_needs_min_trainers_and_takes_more_as_they_come() {
        let mut slots = Slots::new((2, 4), (true, false), 2);
        let server = slots.next_allocation(false).unwrap();
        assert_eq!((server.role, server.at_least), (Role::ParameterServer, 1));
        slots.started(4, "ps");
        slots.allocation_ended();
        let first = slots.next_allocation(false).unwrap();
        assert_eq!(
            first,
            Allocation {
                role: Role::Trainer,
                slots: vec![0, 1, 2, 3],
                at_least: 2
            }
        );
        slots.started(0, "a");
        slots.started(1, "b");
        slots.allocation_ended();
        assert_eq!(slots.next_allocation(false), None, "more are optional");
        let more = slots.next_allocation(true).unwrap();
        assert_eq!((more.slots, more.at_least), (vec![2, 3], 0));
        slots.started(2, "c");
        slots.allocation_ended();
        // A lost trainer above min is not needed back; below min it is.
        assert_eq!(slots.failed("c", false), Verdict::Replace);
        assert_eq!(slots.next_allocation(false), None);
        assert_eq!(slots.failed("a", false), Verdict::Replace);
        let needed = slots.next_allocation(false).unwrap();
        assert_eq!((needed.slots, needed.at_least), (vec![0, 2, 3], 1));
        slots.started(3, "d");
        slots.allocation_ended();
        // Slot 3 spends its attempts while two others run: it is given up, the run goes on.
        assert_eq!(slots.failed("d", false), Verdict::Replace);
        slots.next_allocation(false).unwrap();
        slots.started(3, "d2");
        slots.started(0, "a2");
        slots.allocation_ended();
        assert_eq!(
            slots.failed("d2", false),
            Verdict::GivenUp {
                slot: 3,
                attempts: 2
            }
        );
        // A trainer that did some of the work gives its slot its attempts back.
        slots.next_allocation(true).unwrap();
        slots.started(2, "c2");
        slots.allocation_ended();
        assert_eq!(slots.attempts(2), 2);
        assert_eq!(slots.failed("c2", true), Verdict::Replace);
        assert_eq!(slots.attempts(2), 0);
        // The work is over: the wanted slot is given up, and the run completes with its jobs.
        slots.close();
        assert_eq!(slots.next_allocation(true), None);
        assert_eq!(slots.finished("a2"), Verdict::Done);
        assert_eq!(slots.finished("b"), Verdict::Done);
        assert!(!slots.complete(), "the parameter server runs");
        assert_eq!(slots.finished("ps"), Verdict::Done);
        assert!(slots.complete());
    }

    #[test]
    fn the_parameter_server_is_allocated_first_and_alone() {
        let mut slots = Slots::new((3, 3), (true, false), 2);
        assert_eq!(next(&mut slots), Some((Role::ParameterServer, vec![3])));
        assert_eq!(next(&mut slots), None, "one allocation at a time");
        slots.started(3, "ps");
        slots.allocation_ended();
        assert_eq!(next(&mut slots), Some((Role::Trainer, vec![0, 1, 2])));
        for (slot, job) in ["a", "b", "c"].iter().enumerate() {
            slots.started(slot, job);
        }
        slots.allocation_ended();
        assert_eq!(next(&mut slots), None, "nothing is wanted");
        assert_eq!(slots.running().count(), 4);
    }

    #[test]
    fn slots_without_a_worker_are_wanted_again_and_a_failure_is_replaced() {
        let mut slots = Slots::new((2, 2), (false, false), 2);
        assert_eq!(next(&mut slots), Some((Role::Trainer, vec![0, 1])));
        slots.started(0, "a");
        slots.allocation_ended();
        assert_eq!(slots.state(1), Some(&SlotState::Wanted));
        assert_eq!(next(&mut slots), Some((Role::Trainer, vec![1])));
        slots.started(1, "b");
        slots.allocation_ended();

        assert_eq!(slots.failed("a", false), Verdict::Replace);
        assert_eq!(slots.failed("a", false), Verdict::Unknown, "reported twice");
        assert_eq!(next(&mut slots), Some((Role::Trainer, vec![0])));
        slots.started(0, "a2");
        slots.allocation_ended();
        assert_eq!(slots.attempts(0), 2);
        assert_eq!(slots.finished("b"), Verdict::Done);
        assert!(!slots.complete());
        assert_eq!(slots.finished("a2"), Verdict::Done);
        assert!(slots.complete());
        assert_eq!(
            slots.finished("a"),
            Verdict::Unknown,
            "a replaced job that ends late changes nothing"
        );
    }

    #[test]
    fn slots_being_adopted_are_not_allocated_and_are_wanted_when_adoption_fails() {
        let mut slots = Slots::new((2, 2), (true, false), 2);
        slots.adopting(0);
        slots.adopting(2);
        assert_eq!(next(&mut slots), Some((Role::Trainer, vec![1])));
        slots.allocation_ended();
        assert_eq!(slots.state(0), Some(&SlotState::Adopting), "{slots:?}");
        slots.started(0, "a");
        slots.adoption_failed(2);
        slots.adoption_failed(0);
        assert_eq!(
            slots.state(0),
            Some(&SlotState::Running { job: "a".into() })
        );
        assert_eq!(next(&mut slots), Some((Role::ParameterServer, vec![2])));
    }

    #[test]
    fn a_slot_that_fails_its_attempts_ends_the_run() {
        let mut slots = Slots::new((1, 1), (false, false), 2);
        next(&mut slots);
        slots.started(0, "a");
        slots.allocation_ended();
        assert_eq!(slots.failed("a", false), Verdict::Replace);
        next(&mut slots);
        slots.started(0, "b");
        slots.allocation_ended();
        assert_eq!(
            slots.failed("b", false),
            Verdict::Exhausted {
                slot: 0,
                attempts: 2
            }
        );
    }

    #[test]
    fn the_standby_comes_last_is_optional_and_takes_the_servers_slot_when_it_is_lost() {
        let mut slots = Slots::new((2, 2), (true, true), 2);
        assert_eq!(next(&mut slots), Some((Role::ParameterServer, vec![2])));
        slots.started(2, "ps");
        slots.allocation_ended();
        assert_eq!(next(&mut slots), Some((Role::Trainer, vec![0, 1])));
        slots.started(0, "a");
        slots.started(1, "b");
        slots.allocation_ended();
        // Optional: not while joiners pause, and finding none is no failure.
        assert_eq!(slots.next_allocation(false), None);
        let standby = slots.next_allocation(true).unwrap();
        assert_eq!(
            (standby.role, standby.slots, standby.at_least),
            (Role::Standby, vec![3], 0)
        );
        slots.started(3, "sb");
        slots.allocation_ended();

        assert!(!slots.promote("a", "sb"), "only the server's job makes way");
        assert!(slots.promote("ps", "sb"));
        assert_eq!(slots.slot_of("sb"), Some(2));
        assert_eq!(slots.role(2), Role::ParameterServer);
        assert_eq!(slots.state(3), Some(&SlotState::Wanted));
        assert_eq!(next(&mut slots), Some((Role::Standby, vec![3])));
        slots.started(3, "sb2");
        slots.allocation_ended();

        // An elastic run below its `max` leases the standby before more trainers.
        let mut elastic = Slots::new((1, 3), (true, true), 2);
        assert_eq!(next(&mut elastic), Some((Role::ParameterServer, vec![3])));
        elastic.started(3, "ps");
        elastic.allocation_ended();
        assert_eq!(next(&mut elastic), Some((Role::Trainer, vec![0, 1, 2])));
        elastic.started(0, "a");
        elastic.allocation_ended();
        assert_eq!(next(&mut elastic), Some((Role::Standby, vec![4])));
        elastic.allocation_ended();

        // A standby that fails its attempts is given up; the run goes on.
        assert_eq!(slots.failed("sb2", false), Verdict::Replace);
        assert_eq!(next(&mut slots), Some((Role::Standby, vec![3])));
        slots.started(3, "sb3");
        slots.allocation_ended();
        assert_eq!(
            slots.failed("sb3", false),
            Verdict::GivenUp {
                slot: 3,
                attempts: 2
            }
        );
        assert_eq!(next(&mut slots), None);
    }
}
