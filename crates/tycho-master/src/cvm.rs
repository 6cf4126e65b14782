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
//! Caretaking is marked in the group record, so that a caretaken group counts as missing its
//! primary. The functions here decide; `ha` acts (with compare-and-swap on the record).

use crate::ownership::GroupRecord;

/// One group as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupView {
    /// The record, `None` while the group does not exist yet.
    pub record: Option<GroupRecord>,
    /// Its primary serves it only until a master of its own claims it.
    pub caretaken: bool,
}

impl From<Option<GroupRecord>> for GroupView {
    fn from(record: Option<GroupRecord>) -> GroupView {
        let caretaken = record.as_ref().is_some_and(|r| r.caretaken);
        GroupView { record, caretaken }
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

    // Free masters: neither a live native primary nor anyone's standby, oldest first.
    let busy = |id: &str| {
        groups.iter().enumerate().any(|(r, v)| {
            native(r) == Some(id) || v.record.as_ref().is_some_and(|rec| rec.standbys.iter().any(|s| s == id))
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
    let mine = free.iter().position(|id| id.as_str() == me).and_then(|i| to_fill.get(i).copied()).filter(|_| all_exist);
    for (r, v) in groups.iter().enumerate() {
        let rank = r as u32;
        let Some(rec) = &v.record else {
            if live.first().is_some_and(|first| first == me) {
                out.push((rank, Action::Create { caretake: r != 0 }));
            }
            continue;
        };
        let standbys = live_standbys(live, rec);
        if rec.primary == me {
            let action = match (holds(rank), standbys.first()) {
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
        if rec.standbys.iter().any(|s| s == me) {
            // Of a caretaken group's standbys, the first live one claims it; the others follow.
            let claims = v.caretaken && standbys.first().is_some_and(|s| *s == me);
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
    use crate::ownership::GroupState;

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
        let groups = vec![GroupView { record: None, caretaken: false }; 4];
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
        groups.extend(vec![GroupView { record: None, caretaken: false }; 2]);
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
        let none = GroupView { record: None, caretaken: false };
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
                    0 => GroupView { record: None, caretaken: false },
                    _ => {
                        let p = ids[next(6) as usize];
                        let s: Vec<&str> = (0..next(3)).map(|_| ids[next(6) as usize]).collect();
                        view(r as u32, p, &s, next(3) == 0)
                    }
                })
                .collect();
            let mut changers = vec![Vec::new(); g];
            let mut standby_of = Vec::new();
            for me in &l {
                for (r, a) in plan(me, &l, &groups, |_| next(2) == 0) {
                    match a {
                        Action::Create { .. } | Action::TakeOver { .. } | Action::Claim => {
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
