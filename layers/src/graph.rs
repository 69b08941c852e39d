//! Circles in a graph of use: the one search both checks share.

use std::collections::{BTreeMap, BTreeSet};

/// One circle in the use graph, as the path that closes it.
pub fn find_circle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == node) {
            let mut circle = path[at..].to_vec();
            circle.push(node.to_string());
            return Some(circle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(c) = visit(next, edges, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for node in edges.keys() {
        if let Some(c) = visit(node, edges, &mut Vec::new(), &mut done) {
            return Some(c);
        }
    }
    None
}

/// Every circle of the graph, one at a time: each found is broken at the
/// edge that closes it before the next search, so a graph of `e` edges
/// gives at most `e`.
pub fn all_circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    let mut left = edges.clone();
    let mut out = Vec::new();
    while let Some(c) = find_circle(&left) {
        if let [.., from, to] = c.as_slice() {
            if let Some(next) = left.get_mut(from) {
                next.remove(to);
            }
        }
        out.push(c);
    }
    out
}
