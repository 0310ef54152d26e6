//! The prefix cache: a radix tree over full blocks of token ids, shared by every sequence of a
//! [`super::KvCache`]. A path from the root spells a token prefix one block at a time; each node
//! holds a reference on the block that cached those positions. A new sequence whose tokens start
//! with a cached path takes those blocks into its page table (one more reference each) and
//! computes only the rest. Blocks held by the tree alone are evicted least recently used first,
//! leaves before their parents, when the pool runs short.
//!
//! Only full blocks are cached: a block's contents depend on every token before it and on its
//! own `block_size` tokens, which is exactly what the path to its node spells.

use std::collections::HashMap;

use super::pool::BlockPool;

struct Node {
    /// The block's tokens (the edge from the parent).
    tokens: Vec<u32>,
    block: u32,
    parent: usize,
    children: HashMap<Vec<u32>, usize>,
    last_used: u64,
}

const ROOT: usize = 0;

pub struct PrefixCache {
    block_size: usize,
    /// Slab of nodes; `None` is a free slot. Node 0 is the root (no block).
    nodes: Vec<Option<Node>>,
    free_nodes: Vec<usize>,
    tick: u64,
}

impl PrefixCache {
    pub fn new(block_size: usize) -> PrefixCache {
        PrefixCache {
            block_size,
            nodes: vec![Some(Node {
                tokens: Vec::new(),
                block: u32::MAX,
                parent: ROOT,
                children: HashMap::new(),
                last_used: 0,
            })],
            free_nodes: Vec::new(),
            tick: 0,
        }
    }

    fn node(&self, i: usize) -> &Node {
        self.nodes[i].as_ref().expect("live node")
    }

    fn node_mut(&mut self, i: usize) -> &mut Node {
        self.nodes[i].as_mut().expect("live node")
    }

    /// Blocks the tree holds.
    pub fn len(&self) -> usize {
        self.nodes.iter().flatten().count() - 1
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The cached blocks spelling the longest prefix of `tokens` made of at most `max_blocks`
    /// whole blocks, each retained once for the caller.
    pub fn lookup(&mut self, pool: &mut BlockPool, tokens: &[u32], max_blocks: usize) -> Vec<u32> {
        self.tick += 1;
        let mut at = ROOT;
        let mut out = Vec::new();
        for chunk in tokens.chunks_exact(self.block_size).take(max_blocks) {
            let Some(&next) = self.node(at).children.get(chunk) else {
                break;
            };
            let tick = self.tick;
            let n = self.node_mut(next);
            n.last_used = tick;
            pool.retain(n.block);
            out.push(n.block);
            at = next;
        }
        out
    }

    /// Records that `blocks[i]` holds positions `i·block_size..(i+1)·block_size` of `tokens`, for
    /// every whole block. Where the tree already has a block for a prefix, it keeps its own.
    pub fn insert(&mut self, pool: &mut BlockPool, tokens: &[u32], blocks: &[u32]) {
        self.tick += 1;
        let mut at = ROOT;
        for (chunk, &block) in tokens.chunks_exact(self.block_size).zip(blocks) {
            let next = match self.node(at).children.get(chunk) {
                Some(&n) => n,
                None => {
                    pool.retain(block);
                    let node = Node {
                        tokens: chunk.to_vec(),
                        block,
                        parent: at,
                        children: HashMap::new(),
                        last_used: 0,
                    };
                    let i = match self.free_nodes.pop() {
                        Some(i) => {
                            self.nodes[i] = Some(node);
                            i
                        }
                        None => {
                            self.nodes.push(Some(node));
                            self.nodes.len() - 1
                        }
                    };
                    self.node_mut(at).children.insert(chunk.to_vec(), i);
                    i
                }
            };
            let tick = self.tick;
            self.node_mut(next).last_used = tick;
            at = next;
        }
    }

    /// Blocks eviction could free now: nodes whose whole subtree the tree alone holds.
    pub fn evictable(&self, pool: &BlockPool) -> usize {
        fn walk(t: &PrefixCache, pool: &BlockPool, i: usize, n: &mut usize) -> bool {
            let node = t.node(i);
            let mut all = true;
            for &c in node.children.values() {
                all &= walk(t, pool, c, n);
            }
            if i != ROOT && all && pool.refcount(node.block) == 1 {
                *n += 1;
                return true;
            }
            false
        }
        let mut n = 0;
        walk(self, pool, ROOT, &mut n);
        n
    }

    /// Frees up to `want` blocks, least recently used leaves first, among blocks no sequence
    /// holds. Returns how many were freed.
    pub fn evict(&mut self, pool: &mut BlockPool, want: usize) -> usize {
        let mut freed = 0;
        while freed < want {
            let victim = self
                .nodes
                .iter()
                .enumerate()
                .skip(1)
                .filter_map(|(i, n)| n.as_ref().map(|n| (i, n)))
                .filter(|(_, n)| n.children.is_empty() && pool.refcount(n.block) == 1)
                .min_by_key(|(i, n)| (n.last_used, *i))
                .map(|(i, _)| i);
            let Some(i) = victim else { break };
            self.remove_leaf(pool, i);
            freed += 1;
        }
        freed
    }

    fn remove_leaf(&mut self, pool: &mut BlockPool, i: usize) {
        let node = self.nodes[i].take().expect("live node");
        debug_assert!(node.children.is_empty());
        self.node_mut(node.parent).children.remove(&node.tokens);
        pool.release(node.block);
        self.free_nodes.push(i);
    }

    /// Drops every node (their blocks lose the tree's reference).
    pub fn clear(&mut self, pool: &mut BlockPool) {
        for i in 1..self.nodes.len() {
            if let Some(n) = self.nodes[i].take() {
                pool.release(n.block);
                self.free_nodes.push(i);
            }
        }
        self.node_mut(ROOT).children.clear();
    }

    /// Every block the tree holds (invariant checks).
    pub fn blocks(&self) -> impl Iterator<Item = u32> + '_ {
        self.nodes.iter().skip(1).flatten().map(|n| n.block)
    }

    /// Checks parent/child links agree (tests).
    #[doc(hidden)]
    pub fn check_links(&self) -> Result<(), String> {
        for (i, n) in self.nodes.iter().enumerate().skip(1) {
            let Some(n) = n else { continue };
            if n.tokens.len() != self.block_size {
                return Err(format!("node {i} holds {} tokens", n.tokens.len()));
            }
            match self.nodes.get(n.parent).and_then(|p| p.as_ref()) {
                Some(p) if p.children.get(&n.tokens) == Some(&i) => {}
                _ => return Err(format!("node {i} is not its parent's child")),
            }
        }
        Ok(())
    }
}
