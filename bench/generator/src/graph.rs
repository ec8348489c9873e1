//! The contact graph: every user has exactly K mutual contacts.
//!
//! Users sit on a ring (optionally in a seeded random order, which makes neighbourhoods
//! look random while keeping the graph K-regular and reproducible); each is linked to the
//! K/2 nearest on either side, and for odd K also to the user opposite on the ring.

use rand::seq::SliceRandom;
use rand::SeedableRng;

/// A K-regular undirected graph over users 0..n.
#[derive(Debug, Clone)]
pub struct ContactGraph {
    k: u32,
    /// ring position → user.
    order: Vec<u32>,
    /// user → ring position.
    position: Vec<u32>,
}

impl ContactGraph {
    /// A ring in user order (`seed` None) or in a seeded random order.
    pub fn new(n: u32, k: u32, seed: Option<u64>) -> Result<Self, String> {
        if k == 0 || k >= n {
            return Err(format!("need 0 < contacts ({k}) < users ({n})"));
        }
        if k % 2 == 1 && n % 2 == 1 {
            return Err(format!(
                "an odd contact count ({k}) needs an even user count ({n})"
            ));
        }
        let mut order: Vec<u32> = (0..n).collect();
        if let Some(seed) = seed {
            order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
        }
        let mut position = vec![0u32; n as usize];
        for (pos, &u) in order.iter().enumerate() {
            position[u as usize] = pos as u32;
        }
        Ok(ContactGraph { k, order, position })
    }

    /// Number of users.
    pub fn len(&self) -> u32 {
        self.order.len() as u32
    }

    /// Contacts per user.
    pub fn k(&self) -> u32 {
        self.k
    }

    /// The K contacts of `user`.
    pub fn contacts(&self, user: u32) -> Vec<u32> {
        let n = i64::from(self.len());
        let p = i64::from(self.position[user as usize]);
        let mut out = Vec::with_capacity(self.k as usize);
        for d in 1..=i64::from(self.k / 2) {
            for q in [p + d, p - d] {
                out.push(self.order[q.rem_euclid(n) as usize]);
            }
        }
        if self.k % 2 == 1 {
            out.push(self.order[(p + n / 2).rem_euclid(n) as usize]);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn check_regular_and_symmetric(g: &ContactGraph) {
        for u in 0..g.len() {
            let c = g.contacts(u);
            let set: HashSet<u32> = c.iter().copied().collect();
            assert_eq!(
                set.len(),
                g.k() as usize,
                "user {u} has duplicate contacts {c:?}"
            );
            assert!(!set.contains(&u), "user {u} is its own contact");
            for v in set {
                assert!(g.contacts(v).contains(&u), "{u}→{v} not mutual");
            }
        }
    }

    #[test]
    fn ring_and_shuffled_ring_are_k_regular_and_mutual() {
        check_regular_and_symmetric(&ContactGraph::new(20, 3, None).expect("valid"));
        check_regular_and_symmetric(&ContactGraph::new(1000, 10, None).expect("valid"));
        check_regular_and_symmetric(&ContactGraph::new(101, 10, Some(7)).expect("valid"));
        check_regular_and_symmetric(&ContactGraph::new(12, 11, Some(1)).expect("valid"));
    }

    #[test]
    fn impossible_graphs_are_refused() {
        assert!(ContactGraph::new(5, 5, None).is_err());
        assert!(ContactGraph::new(21, 3, None).is_err());
        assert!(ContactGraph::new(10, 0, None).is_err());
    }
}
