//! The role rules of the partitioned plane (spec 01's CVM) for G KVPT groups, as a pure
//! function: every master applies [`plan`] to the same view of the coordination store (the
//! live registrations, oldest first, and the G group records) and learns what it should do about
//! each group. No master leads; two masters that act on one view never act on the same group in
//! conflicting ways, and a change that lost a race fails its compare-and-swap, after which the
//! loser plans again from the new view.
//!
//! The rules, in order:
//!
//! 1. **Bootstrap.** A group without a record is created by the oldest live master: group 0 as
//!    its primary, the others as their caretaker.
//! 2. **Serving.** A master named primary (natively or as caretaker) serves the group if it holds
//!    its state; if it restarted without it, it hands the group to a live standby, or restores
//!    it from snapshot and log.
//! 3. **Failover.** When a group's primary is not live, its first live standby takes it over;
//!    without one, the native primary of the preceding group that has one (wrapping round)
//!    takes it over as caretaker, from snapshot and log; without any, the oldest live master.
//! 4. **Filling roles.** Masters that are neither a native primary nor a standby ("free"), oldest
//!    first, are paired with the groups missing a native primary (a caretaken group whose
//!    caretaker is live), lowest rank first: each joins that group as its standby, catches up,
//!    and claims it with a planned switch. Free masters left over are paired with the groups
//!    that have a live native primary but no live standby (pairing is 1:1: a master is the
//!    standby of one group at most). The rest wait, idle.
//!
//! 5. **Reshard.** While an operator's request to move a group ([`crate::cluster::reshard`]) holds, its
//!    target joins the group's standbys, catches up, sets the record migrating and, once the
//!    source has frozen writes, promotes itself; no other standby claims the group meanwhile.
//!    A request that no longer holds (past its deadline, its target gone, its source no longer
//!    the primary, or the target primary already) is ended by the group's primary, which lifts
//!    the freeze if there is one; so is a record left migrating without a request.
//!
//! Caretaking is marked in the group record, so that a caretaken group counts as missing its
//! primary. The functions here decide; `ha` acts (with compare-and-swap on the record).

use crate::cluster::ownership::{GroupRecord, GroupState};

/// One group as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupView {
    /// The record, `None` while the group does not exist yet.
    pub record: Option<GroupRecord>,
    /// Its primary serves it only until a master of its own claims it.
    pub caretaken: bool,
    /// An operator's request to move the group, if there is one.
    pub reshard: Option<Reshard>,
}

/// A reshard request as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reshard {
    /// The group's primary when it was requested.
    pub source: String,
    /// The master it moves to.
    pub target: String,
    /// The group's epoch when it was requested.
    pub epoch: u64,
    /// Its deadline has passed.
    pub expired: bool,
}

impl From<Option<GroupRecord>> for GroupView {
    fn from(record: Option<GroupRecord>) -> GroupView {
        let caretaken = record.as_ref().is_some_and(|r| r.caretaken);
        GroupView { record, caretaken, reshard: None }
    }
}

impl GroupView {
    /// A group as the planner sees it at `now_ms` (Unix ms): its record (`None` before it
    /// exists) and its reshard request, if any.
    pub fn of(
        record: Option<&GroupRecord>,
        intent: Option<&crate::cluster::reshard::ReshardIntent>,
        now_ms: u64,
    ) -> GroupView {
        GroupView {
            reshard: intent.map(|i| Reshard {
                source: i.source.clone(),
                target: i.target.clone(),
                epoch: i.epoch,
                expired: i.expired(now_ms),
            }),
            ..GroupView::from(record.cloned())
        }
    }

    /// Whether the group's reshard request still holds: requested from the current primary,
    /// live and at the same epoch (no failover since), to another live master, within its
    /// deadline.
    fn reshard_holds(&self, live: &[String]) -> bool {
        match (&self.record, &self.reshard) {
            (Some(rec), Some(x)) => {
                x.source == rec.primary
                    && x.epoch == rec.epoch
                    && x.target != rec.primary
                    && alive(live, &rec.primary)
                    && alive(live, &x.target)
                    && !x.expired
            }
            _ => false,
        }
    }

    /// Whether the group's primary has a reshard to end: a request that no longer holds, or a
    /// record left migrating without one.
    fn reshard_to_end(&self, live: &[String]) -> bool {
        let migrating = self.record.as_ref().is_some_and(|r| r.state == GroupState::Migrating);
        (self.reshard.is_some() || migrating) && !self.reshard_holds(live)
    }
}

/// What a master should do about one group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Create the group's record naming this master primary (`caretake`: as its caretaker).
    Create {
        /// As caretaker rather than as its own primary.
        caretake: bool,
    },
    /// Serve the group (this master is its primary and holds its state).
    Serve,
    /// This master is named primary but holds nothing of the group (it restarted): hand the
    /// group to this live standby, which has it.
    HandTo(String),
    /// Take the group over: promote (CAS, epoch + 1), from the state this master replayed, or
    /// from snapshot and log when it holds nothing (`caretake`: as its caretaker).
    TakeOver {
        /// As caretaker rather than as its own primary.
        caretake: bool,
    },
    /// Add this master to the group's standbys.
    JoinAsStandby,
    /// Replay the group's log as its standby.
    Follow,
    /// This master is the standby of a caretaken group: once caught up, switch the group to it
    /// by CAS (a planned switch: the caretaker hands over, nothing is exported).
    Claim,
    /// This master is the target of the group's reshard and its standby: catch up, set the
    /// record migrating, and switch once the source has frozen writes.
    Migrate,
    /// This master serves the group and its reshard no longer holds: lift the freeze, if any,
    /// and delete the request.
    EndReshard,
}

/// Whether `id` is live.
fn alive(live: &[String], id: &str) -> bool {
    live.iter().any(|l| l == id)
}

/// What master `me` should do about each group, given the live masters (oldest first: by
/// registration create revision) and every group's view (index = rank). `holds(rank)` says
/// whether `me` holds the group's state (it served or followed it since it started). Groups
/// about which `me` has nothing to do are left out.
pub fn plan(me: &str, live: &[String], groups: &[GroupView], mut holds: impl FnMut(u32) -> bool) -> Vec<(u32, Action)> {
    let g = groups.len();
    let mut out = Vec::new();
    let native = |r: usize| -> Option<&str> {
        let v = &groups[r];
        v.record.as_ref().filter(|rec| !v.caretaken && alive(live, &rec.primary)).map(|rec| rec.primary.as_str())
    };

    // Free masters: neither a live native primary nor anyone's standby nor a reshard's
    // target, oldest first.
    let busy = |id: &str| {
        groups.iter().enumerate().any(|(r, v)| {
            native(r) == Some(id)
                || v.record.as_ref().is_some_and(|rec| rec.standbys.iter().any(|s| s == id))
                || (v.reshard_holds(live) && v.reshard.as_ref().is_some_and(|x| x.target == id))
        })
    };
    let free: Vec<&String> = live.iter().filter(|id| !busy(id)).collect();
    // Groups to fill: first those missing a native primary (caretaken, caretaker live, no
    // standby yet), then those with a native primary and no live standby; rank order each.
    let mut to_fill: Vec<usize> = (0..g)
        .filter(|&r| {
            let v = &groups[r];
            v.caretaken
                && v.record.as_ref().is_some_and(|rec| alive(live, &rec.primary) && live_standbys(live, rec).is_empty())
        })
        .collect();
    to_fill.extend((0..g).filter(|&r| {
        native(r).is_some() && live_standbys(live, groups[r].record.as_ref().expect("native")).is_empty()
    }));
    // Roles are filled only once every group exists: a master that chose from a view where the
    // first master had created some groups only would pair up with a native primary while a
    // group created a moment later waits for a primary of its own.
    let all_exist = groups.iter().all(|v| v.record.is_some());
    // The one group `me` is moving here (the lowest, should several requests name it).
    let moving_here =
        groups.iter().position(|v| v.reshard_holds(live) && v.reshard.as_ref().is_some_and(|x| x.target == me));
    let mine = free.iter().position(|id| id.as_str() == me).and_then(|i| to_fill.get(i).copied()).filter(|_| all_exist);
    for (r, v) in groups.iter().enumerate() {
        let rank = r as u32;
        let Some(rec) = &v.record else {
            if live.first().is_some_and(|first| first == me) {
                out.push((rank, Action::Create { caretake: r != 0 }));
            }
            continue;
        };
        let mut standbys = live_standbys(live, rec);
        // A primary that restarted without the group's state hands it to the target of the
        // group's move, if that is one of its live standbys.
        if let Some(x) = v.reshard.as_ref().filter(|_| v.reshard_holds(live)) {
            if let Some(i) = standbys.iter().position(|s| **s == x.target) {
                let target = standbys.remove(i);
                standbys.insert(0, target);
            }
        }
        if rec.primary == me {
            let action = match (holds(rank), standbys.first()) {
                (true, _) if v.reshard_to_end(live) => Action::EndReshard,
                (true, _) => Action::Serve,
                (false, Some(s)) => Action::HandTo(s.to_string()),
                (false, None) => Action::TakeOver { caretake: v.caretaken },
            };
            out.push((rank, action));
            continue;
        }
        if !alive(live, &rec.primary) {
            let heir = match standbys.first() {
                Some(s) => Some((s.as_str(), false)),
                // The oldest live master as a last resort: as caretaker if it is the native
                // primary of another group, else as the group's own primary.
                None => preceding_native(r, g, &native).map(|p| (p, true)).or_else(|| {
                    live.first().map(|f| (f.as_str(), (0..g).any(|o| o != r && native(o) == Some(f.as_str()))))
                }),
            };
            if let Some((_, caretake)) = heir.filter(|(id, _)| *id == me) {
                out.push((rank, Action::TakeOver { caretake }));
            }
            continue;
        }
        if moving_here == Some(r) {
            let joined = rec.standbys.iter().any(|s| s == me);
            out.push((rank, if joined { Action::Migrate } else { Action::JoinAsStandby }));
            continue;
        }
        if rec.standbys.iter().any(|s| s == me) {
            // Of a caretaken group's standbys, the first live one claims it, unless the group is
            // moving elsewhere; the others follow.
            let claims = v.caretaken && !v.reshard_holds(live) && standbys.first().is_some_and(|s| *s == me);
            out.push((rank, if claims { Action::Claim } else { Action::Follow }));
            continue;
        }
        if mine == Some(r) {
            out.push((rank, Action::JoinAsStandby));
        }
    }
    out
}

/// The live standbys of a group, in the record's order (its primary left out).
fn live_standbys<'a>(live: &[String], rec: &'a GroupRecord) -> Vec<&'a String> {
    rec.standbys.iter().filter(|s| alive(live, s) && **s != rec.primary).collect()
}

/// The live native primary of the nearest group before `r` that has one (wrapping round).
fn preceding_native<'a>(r: usize, g: usize, native: &impl Fn(usize) -> Option<&'a str>) -> Option<&'a str> {
    (1..g).map(|back| (r + g - back) % g).find_map(native)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(rank: u32, primary: &str, standbys: &[&str]) -> GroupRecord {
        GroupRecord {
            rank,
            primary: primary.into(),
            standbys: standbys.iter().map(|s| s.to_string()).collect(),
            state: GroupState::Stable,
            migrating_to: None,
            epoch: 1,
            caretaken: false,
        }
    }

    fn view(rank: u32, primary: &str, standbys: &[&str], caretaken: bool) -> GroupView {
        GroupView::from(Some(GroupRecord { caretaken, ..rec(rank, primary, standbys) }))
    }

    fn live(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    fn all(_: u32) -> bool {
        true
    }

    #[test]
    fn the_first_master_creates_every_group_and_caretakes_all_but_the_first() {
        let groups = vec![GroupView { record: None, caretaken: false, reshard: None }; 4];
        let l = live(&["a", "b"]);
        assert_eq!(
            plan("a", &l, &groups, all),
            vec![
                (0, Action::Create { caretake: false }),
                (1, Action::Create { caretake: true }),
                (2, Action::Create { caretake: true }),
                (3, Action::Create { caretake: true }),
            ]
        );
        assert!(plan("b", &l, &groups, all).is_empty());
    }

    #[test]
    fn joining_masters_fill_missing_primaries_first_then_standbys() {
        // G = 4: a serves 0 and caretakes 1..3; b, c, d join (oldest first).
        let mut groups = vec![view(0, "a", &[], false)];
        groups.extend((1..4).map(|r| view(r, "a", &[], true)));
        let l = live(&["a", "b", "c", "d", "e"]);
        assert_eq!(plan("b", &l, &groups, all), vec![(1, Action::JoinAsStandby)]);
        assert_eq!(plan("c", &l, &groups, all), vec![(2, Action::JoinAsStandby)]);
        assert_eq!(plan("d", &l, &groups, all), vec![(3, Action::JoinAsStandby)]);
        // e is left over for the missing standby of group 0.
        assert_eq!(plan("e", &l, &groups, all), vec![(0, Action::JoinAsStandby)]);
        assert_eq!(plan("a", &l, &groups, all).len(), 4, "a serves all four meanwhile");
        // Once listed, a caretaken group's standby claims it.
        groups[1] = view(1, "a", &["b"], true);
        assert_eq!(plan("b", &l, &groups, all), vec![(1, Action::Claim)]);
        // After the switch b is a native primary; c and d keep their groups.
        groups[1] = view(1, "b", &[], false);
        assert_eq!(plan("c", &l, &groups, all), vec![(2, Action::JoinAsStandby)]);
    }

    #[test]
    fn with_two_groups_and_four_masters_standbys_pair_one_to_one() {
        let groups = vec![view(0, "a", &[], false), view(1, "b", &[], false)];
        let l = live(&["a", "b", "c", "d"]);
        assert_eq!(plan("c", &l, &groups, all), vec![(0, Action::JoinAsStandby)]);
        assert_eq!(plan("d", &l, &groups, all), vec![(1, Action::JoinAsStandby)]);
        let groups = vec![view(0, "a", &["c"], false), view(1, "b", &["d"], false)];
        assert_eq!(plan("c", &l, &groups, all), vec![(0, Action::Follow)]);
        assert!(plan("e", &live(&["a", "b", "c", "d", "e"]), &groups, all).is_empty(), "a fifth master idles");
    }

    #[test]
    fn a_dead_primary_is_replaced_by_its_standby_else_by_the_preceding_primary_as_caretaker() {
        let groups = vec![view(0, "a", &["c"], false), view(1, "b", &[], false), view(2, "x", &[], false)];
        let l = live(&["a", "b", "c"]);
        // Group 2's primary x is dead, without a standby: b (group 1, before it) caretakes.
        assert_eq!(plan("b", &l, &groups, all), vec![(1, Action::Serve), (2, Action::TakeOver { caretake: true })]);
        assert!(plan("a", &l, &groups, all).iter().all(|(r, _)| *r != 2));
        // a dies: its standby c promotes.
        let l = live(&["b", "c"]);
        assert_eq!(plan("c", &l, &groups, all), vec![(0, Action::TakeOver { caretake: false })]);
        // A restarted primary without state hands over to its live standby.
        let l = live(&["a", "b", "c"]);
        assert_eq!(plan("a", &l, &groups, |_| false), vec![(0, Action::HandTo("c".into()))]);
    }

    /// Over many random views, two masters never both act to change who serves one group.
    #[test]
    fn no_role_is_filled_before_every_group_exists() {
        // The first master has created groups 0 and 1 of 4 so far.
        let mut groups = vec![view(0, "a", &[], false), view(1, "a", &[], true)];
        groups.extend(vec![GroupView { record: None, caretaken: false, reshard: None }; 2]);
        let l = live(&["a", "b", "c"]);
        assert!(plan("b", &l, &groups, all).is_empty());
        assert!(plan("c", &l, &groups, all).is_empty());
        groups[2] = view(2, "a", &[], true);
        groups[3] = view(3, "a", &[], true);
        assert_eq!(plan("b", &l, &groups, all), vec![(1, Action::JoinAsStandby)]);
        assert_eq!(plan("c", &l, &groups, all), vec![(2, Action::JoinAsStandby)]);
    }

    /// With G = 1 the rules are those of a single group with a standby (the HA issue).
    #[test]
    fn with_one_group_the_rules_are_the_single_masters() {
        let one = |me: &str, l: &[&str], v: GroupView, holds: bool| {
            let mut p = plan(me, &live(l), &[v], |_| holds);
            assert!(p.len() <= 1);
            p.pop().map(|(_, a)| a)
        };
        let none = GroupView { record: None, caretaken: false, reshard: None };
        let all3 = ["a", "b", "c"];
        // No group yet: only the oldest creates it, as its own primary.
        assert_eq!(one("a", &all3, none.clone(), false), Some(Action::Create { caretake: false }));
        assert_eq!(one("b", &all3, none, false), None);
        // A primary without a standby: the oldest master without a role joins.
        let g = view(0, "a", &[], false);
        assert_eq!(one("a", &all3, g.clone(), true), Some(Action::Serve));
        assert_eq!(one("b", &all3, g.clone(), true), Some(Action::JoinAsStandby));
        assert_eq!(one("c", &all3, g, true), None);
        // With a standby, later masters wait idle; the standby follows.
        let g = view(0, "a", &["b"], false);
        assert_eq!(one("b", &all3, g.clone(), true), Some(Action::Follow));
        assert_eq!(one("c", &all3, g.clone(), true), None);
        // The primary dies: its standby takes over, nobody else, even a master registered
        // before it.
        assert_eq!(one("b", &["c", "b"], g.clone(), true), Some(Action::TakeOver { caretake: false }));
        assert_eq!(one("c", &["c", "b"], g.clone(), true), None);
        // Primary and standby dead: the oldest live master takes over, as its own primary.
        assert_eq!(one("c", &["c", "d"], g.clone(), true), Some(Action::TakeOver { caretake: false }));
        assert_eq!(one("d", &["c", "d"], g.clone(), true), None);
        // A restarted primary holds nothing: it hands the group to its live standby, or takes
        // it over itself (from snapshot and log) when it has none.
        assert_eq!(one("a", &all3, g.clone(), false), Some(Action::HandTo("b".into())));
        assert_eq!(one("a", &["a", "c"], g.clone(), false), Some(Action::TakeOver { caretake: false }));
        // A standby listed but dead does not count: a live master joins in its place.
        assert_eq!(one("c", &["a", "c"], g, true), Some(Action::JoinAsStandby));
    }

    #[test]
    fn a_reshard_target_joins_catches_up_and_migrates_and_the_primary_ends_what_no_longer_holds() {
        let abc = live(&["a", "b", "c"]);
        let moving = |standbys: &[&str], caretaken: bool, expired: bool| {
            let mut v = view(0, "a", standbys, caretaken);
            v.reshard = Some(Reshard { source: "a".into(), target: "b".into(), epoch: 1, expired });
            vec![v]
        };
        // The target joins the standbys (though it is no free master), then migrates; the
        // primary serves on; another standby follows, even of a caretaken group.
        let g = moving(&["c"], false, false);
        assert_eq!(plan("b", &abc, &g, all), vec![(0, Action::JoinAsStandby)]);
        assert_eq!(plan("a", &abc, &g, all), vec![(0, Action::Serve)]);
        assert_eq!(plan("c", &abc, &g, all), vec![(0, Action::Follow)]);
        let g = moving(&["c", "b"], true, false);
        assert_eq!(plan("b", &abc, &g, all), vec![(0, Action::Migrate)]);
        assert_eq!(plan("c", &abc, &g, all), vec![(0, Action::Follow)]);
        // Past its deadline, or with its target gone, the primary ends it; the target follows.
        let g = moving(&["c", "b"], false, true);
        assert_eq!(plan("a", &abc, &g, all), vec![(0, Action::EndReshard)]);
        assert_eq!(plan("b", &abc, &g, all), vec![(0, Action::Follow)]);
        assert_eq!(plan("a", &live(&["a", "c"]), &moving(&["c"], false, false), all), vec![(0, Action::EndReshard)]);
        // The source dies: the group fails over as usual (the request is void from then on).
        let g = moving(&["c", "b"], false, false);
        assert_eq!(plan("c", &live(&["b", "c"]), &g, all), vec![(0, Action::TakeOver { caretake: false })]);
        assert_eq!(plan("b", &live(&["b", "c"]), &g, all), vec![]);
        // A source that restarted without the group's state hands it to the target.
        assert_eq!(plan("a", &abc, &g, |_| false), vec![(0, Action::HandTo("b".into()))]);
        // A request from an earlier epoch (the group failed over and came back) is void.
        let mut g = moving(&["c", "b"], false, false);
        g[0].record.as_mut().unwrap().epoch = 2;
        assert_eq!(plan("a", &abc, &g, all), vec![(0, Action::EndReshard)]);
        assert_eq!(plan("b", &abc, &g, all), vec![(0, Action::Follow)]);
        // Two requests naming one target: it takes the lower group first.
        let mut two = moving(&["c"], false, false);
        two.push(moving(&["c"], false, false).remove(0));
        two[1].record.as_mut().unwrap().rank = 1;
        assert_eq!(plan("b", &abc, &two, all), vec![(0, Action::JoinAsStandby)]);
        // Switched: the new primary deletes the request.
        let mut g = moving(&["c"], false, false);
        g[0].record.as_mut().unwrap().primary = "b".into();
        assert_eq!(plan("b", &abc, &g, all), vec![(0, Action::EndReshard)]);
        // A record left migrating without a request is lifted by its primary.
        let mut g = vec![view(0, "a", &["c"], false)];
        g[0].record.as_mut().unwrap().state = GroupState::Migrating;
        assert_eq!(plan("a", &abc, &g, all), vec![(0, Action::EndReshard)]);
    }

    #[test]
    fn no_two_masters_change_one_group_in_the_same_view() {
        let ids = ["a", "b", "c", "d", "e", "f"];
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..5000 {
            let g = 1 + next(5) as usize;
            let l: Vec<String> = ids.iter().filter(|_| next(4) != 0).map(|s| s.to_string()).collect();
            let groups: Vec<GroupView> = (0..g)
                .map(|r| match next(6) {
                    0 => GroupView { record: None, caretaken: false, reshard: None },
                    _ => {
                        let p = ids[next(6) as usize];
                        let s: Vec<&str> = (0..next(3)).map(|_| ids[next(6) as usize]).collect();
                        let mut v = view(r as u32, p, &s, next(3) == 0);
                        if next(3) == 0 {
                            let source = if next(4) == 0 { ids[next(6) as usize] } else { p };
                            let target = ids[next(6) as usize].to_string();
                            let epoch = if next(4) == 0 { 2 } else { 1 };
                            v.reshard = Some(Reshard { source: source.into(), target, epoch, expired: next(5) == 0 });
                        }
                        if next(4) == 0 {
                            v.record.as_mut().unwrap().state = GroupState::Migrating;
                        }
                        v
                    }
                })
                .collect();
            let mut changers = vec![Vec::new(); g];
            let mut standby_of = Vec::new();
            for me in &l {
                for (r, a) in plan(me, &l, &groups, |_| next(2) == 0) {
                    match a {
                        // (EndReshard changes neither primary nor epoch: a claim racing it wins
                        // or loses its compare-and-swap, and the loser decides again.)
                        Action::Create { .. } | Action::TakeOver { .. } | Action::Claim | Action::Migrate => {
                            changers[r as usize].push(me.clone())
                        }
                        Action::HandTo(heir) => changers[r as usize].push(heir),
                        Action::JoinAsStandby => standby_of.push(me.clone()),
                        _ => {}
                    }
                }
            }
            for (r, c) in changers.iter_mut().enumerate() {
                // A restarted primary handing a group to its standby and that standby's own
                // claim name the same master: one change, whichever CAS lands first.
                c.sort();
                c.dedup();
                assert!(c.len() <= 1, "group {r} changed towards {c:?} in {groups:?} with live {l:?}");
            }
            let mut joined = standby_of.clone();
            joined.dedup();
            assert_eq!(joined.len(), standby_of.len(), "a master joined two groups: {standby_of:?}");
        }
    }
}
