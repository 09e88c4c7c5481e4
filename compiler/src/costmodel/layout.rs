//! How a model is laid out on the cluster: the mesh (`tp`, `pp`, `ep`, `dp`, `cp`), the
//! batch (`--seq`, `--micro-batch-size`, micro-batches), the training options, and which
//! layers each pipeline stage (model chunk) holds.

/// Activation recomputation in the backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recompute {
    /// Every activation the backward needs is stored.
    None,
    /// Norm outputs, the SwiGLU activation and the attention's up-projections (MLA's q/kv
    /// up-projections, GQA's q, k, v) are recomputed in the backward (DeepSeek-V3 §3.3.3's
    /// recomputation of RMSNorm and MLA up-projections; Megatron-LM's `--recompute-modules`
    /// of the same names).
    Selective,
    /// Only each layer's input is stored; the whole layer is recomputed before its backward
    /// (Megatron-LM `--recompute-granularity full --recompute-method uniform`).
    Full,
}

impl Recompute {
    /// Parses `none`, `selective` or `full`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(Recompute::None),
            "selective" => Ok(Recompute::Selective),
            "full" => Ok(Recompute::Full),
            _ => Err(format!("--recompute: `{s}` is not none, selective or full")),
        }
    }
}

/// Number format of the GEMMs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// bf16 GEMMs at the bf16 peak.
    Bf16,
    /// fp8 GEMMs at the fp8 peak (attention core and the rest in bf16; dispatch in fp8,
    /// combine in bf16, as DeepSeek-V3 §3.3 does).
    Fp8,
}

impl Dtype {
    /// Parses `bf16` or `fp8`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "bf16" => Ok(Dtype::Bf16),
            "fp8" => Ok(Dtype::Fp8),
            _ => Err(format!("--dtype: `{s}` is not bf16 or fp8")),
        }
    }
}

/// How the EP all-to-all crosses nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum A2a {
    /// Two levels (DeepSeek-V3 §3.2.2, DeepEP's internode kernels; `run --a2a hierarchical`
    /// on the CPU backend): a token crosses the network once per destination node and is
    /// fanned out over NVLink there. The default.
    #[default]
    Hierarchical,
    /// One level (`run --a2a flat`): every copy of a token bound for an expert on another
    /// node crosses the network, `top_k` copies at most.
    Flat,
}

impl A2a {
    /// Parses `hierarchical` or `flat`. Errors: the message, naming `--a2a`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "hierarchical" => Ok(A2a::Hierarchical),
            "flat" => Ok(A2a::Flat),
            _ => Err(format!("--a2a: `{s}` is not flat or hierarchical")),
        }
    }
}

/// The device mesh: `tp * cp * pp * dp` GPUs; the expert-parallel group of `ep` GPUs is
/// folded into `tp * cp * dp` (Megatron-Core's MoE parallel folding, expert TP = 1), so `ep`
/// divides `tp * cp * dp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mesh {
    /// Tensor-parallel degree (with Megatron's sequence parallelism when above 1).
    pub tp: u32,
    /// Pipeline-parallel degree.
    pub pp: u32,
    /// Expert-parallel degree.
    pub ep: u32,
    /// Data-parallel degree.
    pub dp: u32,
    /// Context-parallel degree (the sequence split over `cp` GPUs).
    pub cp: u32,
}

impl Mesh {
    /// Parses `tp=2,pp=8,ep=32,dp=16,cp=1` (any order, each at most once; missing ones are 1,
    /// `pp` defaults to `pp`). Errors: an unknown or repeated key, a value that is not a
    /// positive integer.
    pub fn parse(s: &str, pp: u32) -> Result<Mesh, String> {
        let mut m = Mesh {
            tp: 1,
            pp,
            ep: 1,
            dp: 1,
            cp: 1,
        };
        let mut seen: Vec<&str> = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("--mesh: `{part}` is not NAME=N"))?;
            let k = k.trim();
            if seen.contains(&k) {
                return Err(format!("--mesh: `{k}` is given twice"));
            }
            let n: u32 = v
                .trim()
                .parse()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("--mesh: {k}={v}: expected a positive integer"))?;
            match k {
                "tp" => m.tp = n,
                "pp" => m.pp = n,
                "ep" => m.ep = n,
                "dp" => m.dp = n,
                "cp" => m.cp = n,
                _ => {
                    return Err(format!(
                        "--mesh: unknown dimension `{k}`: expected tp, pp, ep, dp, cp"
                    ))
                }
            }
            seen.push(match k {
                "tp" => "tp",
                "pp" => "pp",
                "ep" => "ep",
                "dp" => "dp",
                _ => "cp",
            });
        }
        Ok(m)
    }

    /// GPUs in all: `tp * cp * pp * dp`.
    pub fn gpus(&self) -> u64 {
        self.tp as u64 * self.cp as u64 * self.pp as u64 * self.dp as u64
    }

    /// GPUs of one pipeline stage: `tp * cp * dp`.
    pub fn per_stage(&self) -> u64 {
        self.tp as u64 * self.cp as u64 * self.dp as u64
    }
}

/// What one model chunk (pipeline stage of one direction) holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Chunk {
    /// The input embedding.
    pub embedding: bool,
    /// Transformer layers, by index.
    pub layers: Vec<usize>,
    /// Multi-token-prediction modules (DeepSeek-V3 §2.2): a layer and a head each.
    pub mtp: u32,
    /// The final norm, output head and loss.
    pub head: bool,
}

/// Megatron-LM's default split of `layers` transformer layers over `chunks` model chunks
/// (pipeline stages times virtual stages, in model order): the same count in each when it
/// divides; otherwise, when `layers + 2` divides, the embedding and the loss each count as
/// a layer (Megatron-LM's `--account-for-embedding-in-pipeline-split` and
/// `--account-for-loss-in-pipeline-split`: the first and last chunks hold one layer
/// fewer, the Zero Bubble repository's `layers = 4 * PP - 2`). The embedding goes with the
/// first chunk and the head with the last.
///
/// Errors: neither divides (Megatron-LM refuses it too; the message suggests `--layout`),
/// or fewer layers than chunks.
pub fn default_split(layers: u32, chunks: u32) -> Result<Vec<Chunk>, String> {
    if chunks == 0 {
        return Err("no pipeline stages".into());
    }
    let per: Vec<u32> = if layers.is_multiple_of(chunks) {
        vec![layers / chunks; chunks as usize]
    } else if (layers + 2).is_multiple_of(chunks) && chunks >= 2 {
        let q = (layers + 2) / chunks;
        (0..chunks)
            .map(|k| if k == 0 || k == chunks - 1 { q - 1 } else { q })
            .collect()
    } else {
        return Err(format!(
            "{layers} layers do not divide over {chunks} pipeline stages (nor {} with the embedding and the loss counted as layers, Megatron-LM's --account-for-embedding-in-pipeline-split); give --layout, e.g. \"{}\"",
            layers + 2,
            balanced_layout(layers, chunks)
        ));
    };
    let mut out = Vec::with_capacity(chunks as usize);
    let mut next = 0usize;
    for (k, &n) in per.iter().enumerate() {
        out.push(Chunk {
            embedding: k == 0,
            layers: (next..next + n as usize).collect(),
            mtp: 0,
            head: k + 1 == per.len(),
        });
        next += n as usize;
    }
    Ok(out)
}

/// A Megatron-LM layout string of `layers` layers over `chunks` stages where the even split
/// does not divide: every stage `layers / chunks` layers, and the remainder one more each on
/// the middle stages first, the first and the last stage only after them (they also hold
/// the embedding and the output head and loss, the heaviest in memory and the head in
/// time, as Megatron-LM's `--account-for-embedding-in-pipeline-split` and
/// `--account-for-loss-in-pipeline-split` weigh them). `61, 16`: `Et*3`, 13 stages of
/// `t*4`, `t*3`, `t*3L`. Requires `1 <= chunks <= layers`.
pub fn balanced_layout(layers: u32, chunks: u32) -> String {
    let c = chunks.max(1) as usize;
    let (q, r) = (layers / c as u32, (layers % c as u32) as usize);
    let mut n = vec![q; c];
    let order = (1..c.saturating_sub(1))
        .chain([0])
        .chain((c > 1).then_some(c - 1));
    for i in order.take(r) {
        n[i] += 1;
    }
    let stages: Vec<String> = n
        .iter()
        .enumerate()
        .map(|(i, &k)| {
            let body = match k {
                0 => String::new(),
                1 => "t".to_string(),
                k => format!("t*{k}"),
            };
            format!(
                "{}{body}{}",
                if i == 0 { "E" } else { "" },
                if i + 1 == c { "L" } else { "" }
            )
        })
        .collect();
    // Runs of equal stages before the last as `(t*4|)*13`.
    let mut out = String::new();
    let mut i = 0;
    while i < c {
        let mut j = i + 1;
        while j < c - 1 && stages[j] == stages[i] {
            j += 1;
        }
        if i + 1 == c {
            out.push_str(&stages[i]);
        } else if j - i > 1 {
            out.push_str(&format!("({}|)*{}", stages[i], j - i));
        } else {
            out.push_str(&stages[i]);
            out.push('|');
        }
        i = j;
    }
    out
}

/// Parses a Megatron-LM pipeline layout (`--pipeline-model-parallel-layout`): stages
/// separated by `|` in model order, each a string of `E` (embedding), `t` (transformer
/// layer), `m` (multi-token-prediction module) and `L` (head and loss); `X*N` repeats a
/// symbol, `(...)*N` a group (which may hold `|`). Example: `Et|(tt|)*30mL` is DeepSeek-V3's
/// 61 layers on 32 stages.
///
/// Errors, with the 1-based column: a character outside the grammar, an unclosed or
/// unmatched parenthesis, a repetition without a count; then the stage count is not
/// `chunks`, the `t` count is not `layers`, `E` is not alone at the start of the first
/// stage, `L` not at the end of the last.
pub fn parse_layout(s: &str, layers: u32, chunks: u32) -> Result<Vec<Chunk>, String> {
    let chars: Vec<char> = s.chars().collect();
    let mut pos = 0usize;
    let flat = expand(&chars, &mut pos, 0)?;
    if pos < chars.len() {
        return Err(format!(
            "--layout: column {}: `)` without a matching `(`",
            pos + 1
        ));
    }
    let mut stages: Vec<Chunk> = vec![Chunk::default()];
    let mut next = 0usize;
    for (i, &(c, col)) in flat.iter().enumerate() {
        match c {
            '|' => stages.push(Chunk::default()),
            't' => {
                stages.last_mut().expect("one").layers.push(next);
                next += 1;
            }
            'E' => {
                if stages.len() != 1 || !stages[0].layers.is_empty() || stages[0].embedding {
                    return Err(format!(
                        "--layout: column {col}: `E` (the embedding) must open the first stage"
                    ));
                }
                stages[0].embedding = true;
            }
            'm' => stages.last_mut().expect("one").mtp += 1,
            'L' => {
                if i + 1 != flat.len() {
                    return Err(format!(
                        "--layout: column {col}: `L` (the head and loss) must close the last stage"
                    ));
                }
                stages.last_mut().expect("one").head = true;
            }
            _ => unreachable!("expand yields only E t m L |"),
        }
    }
    if stages.len() as u32 != chunks {
        return Err(format!(
            "--layout has {} stage(s), but the schedule has {chunks} model chunk(s) (pipeline stages of one direction)",
            stages.len()
        ));
    }
    if next as u32 != layers {
        return Err(format!(
            "--layout holds {next} transformer layer(s) (`t`), but the model has {layers}"
        ));
    }
    if !stages[0].embedding {
        return Err("--layout: the first stage must hold the embedding (`E`)".into());
    }
    if !stages.last().expect("one").head {
        return Err("--layout: the last stage must hold the head and loss (`L`)".into());
    }
    Ok(stages)
}

/// Expands one level of the layout grammar from `pos` until `)` (depth > 0) or the end:
/// symbols with their 1-based columns.
fn expand(c: &[char], pos: &mut usize, depth: u32) -> Result<Vec<(char, usize)>, String> {
    let mut out: Vec<(char, usize)> = Vec::new();
    while *pos < c.len() {
        let ch = c[*pos];
        let col = *pos + 1;
        match ch {
            'E' | 't' | 'm' | 'L' | '|' => {
                *pos += 1;
                let n = count(c, pos, col)?;
                for _ in 0..n {
                    out.push((ch, col));
                }
            }
            '(' => {
                *pos += 1;
                let inner = expand(c, pos, depth + 1)?;
                if *pos >= c.len() || c[*pos] != ')' {
                    return Err(format!("--layout: column {col}: `(` is never closed"));
                }
                *pos += 1;
                let n = count(c, pos, col)?;
                if inner.len().saturating_mul(n) > 1_000_000 {
                    return Err(format!("--layout: column {col}: the repetition is too long"));
                }
                for _ in 0..n {
                    out.extend_from_slice(&inner);
                }
            }
            ')' if depth > 0 => return Ok(out),
            ')' => return Ok(out),
            ' ' | ',' => *pos += 1,
            _ => {
                return Err(format!(
                    "--layout: column {col}: `{ch}` is not part of a layout (E, t, m, L, |, (...)*N, X*N)"
                ))
            }
        }
    }
    Ok(out)
}

/// An optional `*N` after a symbol or group at `col`.
fn count(c: &[char], pos: &mut usize, col: usize) -> Result<usize, String> {
    if *pos < c.len() && c[*pos] == '*' {
        *pos += 1;
        let start = *pos;
        while *pos < c.len() && c[*pos].is_ascii_digit() {
            *pos += 1;
        }
        let digits: String = c[start..*pos].iter().collect();
        digits
            .parse::<usize>()
            .ok()
            .filter(|&n| n > 0 && n <= 100_000)
            .ok_or_else(|| {
                format!(
                    "--layout: column {}: `*` after column {col} needs a count from 1 to 100000",
                    start
                )
            })
    } else {
        Ok(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_suggested_layout_parses_and_holds_every_layer() {
        for (layers, chunks) in [(61, 16), (61, 32), (30, 7), (94, 32), (5, 4), (9, 8)] {
            let s = balanced_layout(layers, chunks);
            let c = parse_layout(&s, layers, chunks).unwrap_or_else(|e| panic!("{s}: {e}"));
            assert_eq!(c.len() as u32, chunks, "{s}");
            let n: usize = c.iter().map(|c| c.layers.len()).sum();
            assert_eq!(n as u32, layers, "{s}");
        }
    }

    #[test]
    fn megatron_layout_strings_parse() {
        // Megatron-LM's documented PP16 VPP2 example for DeepSeek-V3 (61 layers, one MTP).
        let c = parse_layout("Et*3|(tt|)*29,m|L", 61, 32).unwrap();
        assert_eq!(c[0].layers, vec![0, 1, 2]);
        assert!(c[0].embedding && c[31].head && c[30].mtp == 1);
        assert!(c[31].layers.is_empty());
        // The example.
        let c = parse_layout("Et|(tt|)*30mL", 61, 32).unwrap();
        assert_eq!(c[31].mtp, 1);
        assert_eq!(c[1].layers, vec![1, 2]);
    }

    #[test]
    fn bad_layouts_name_the_column_or_the_count() {
        let e = parse_layout("Et|tx|L", 2, 3).unwrap_err();
        assert!(e.contains("column 5") && e.contains("`x`"), "{e}");
        let e = parse_layout("Et|(tt|*3L", 7, 5).unwrap_err();
        assert!(e.contains("column 4") && e.contains("never closed"), "{e}");
        let e = parse_layout("Et|tt|tL", 6, 3).unwrap_err();
        assert!(
            e.contains("holds 4 transformer layer(s)") && e.contains("has 6"),
            "{e}"
        );
        let e = parse_layout("Et|tt|tL", 4, 4).unwrap_err();
        assert!(
            e.contains("3 stage(s)") && e.contains("4 model chunk"),
            "{e}"
        );
        let e = parse_layout("tE|tL", 2, 2).unwrap_err();
        assert!(e.contains("column 2") && e.contains("`E`"), "{e}");
        let e = parse_layout("Et|Lt", 2, 2).unwrap_err();
        assert!(e.contains("column 4") && e.contains("`L`"), "{e}");
    }

    #[test]
    fn the_default_split_counts_embedding_and_loss_where_that_divides() {
        // The Zero Bubble repository's 30 layers on 8 stages: 3, 4 x 6, 3.
        let c = default_split(30, 8).unwrap();
        let n: Vec<usize> = c.iter().map(|c| c.layers.len()).collect();
        assert_eq!(n, vec![3, 4, 4, 4, 4, 4, 4, 3]);
        // Interleaved with one layer per chunk: the first and last chunks hold none.
        let c = default_split(30, 32).unwrap();
        assert!(c[0].layers.is_empty() && c[31].layers.is_empty() && c[1].layers.len() == 1);
        let e = default_split(61, 16).unwrap_err();
        assert!(e.contains("--layout"), "{e}");
    }
}
