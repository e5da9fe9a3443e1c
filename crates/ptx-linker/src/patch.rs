//! Post-processing of llc's PTX: launch bounds from the kernel table, and link checks.

use mkernel_config::KernelSpec;

/// Alignment of every by-value aggregate parameter of an entry (a launch-parameter block): the
/// 64 bytes a `CUtensorMap` in parameter space needs, so that blocks can open with tensor maps
/// that TMA reads in place (`arch::param`). rustc declares such a parameter `.align 8` (it
/// cannot pass an over-aligned struct to a kernel: TOOLCHAIN.md), and the driver lays the
/// parameter buffer out by the PTX's declaration.
pub const PARAM_BLOCK_ALIGN: u32 = 64;

/// Checks the PTX, inserts each entry's launch bounds and aligns its parameter blocks
/// ([`PARAM_BLOCK_ALIGN`]).
///
/// Errors when the PTX declares an `.extern .func` (a call nothing defines: it would fail at
/// module load on the GPU), when an `.entry` is missing from the table, when a table entry is
/// missing from the PTX, or when an entry already carries launch bounds.
pub fn finish_ptx(ptx: &str, table: &[KernelSpec]) -> Result<String, String> {
    if let Some(line) = ptx.lines().find(|l| l.contains(".extern .func")) {
        return Err(format!(
            "unresolved function in PTX (a device crate calls something no crate defines): `{}`",
            line.trim()
        ));
    }
    let mut out = String::with_capacity(ptx.len() + 256);
    let mut pending: Option<&KernelSpec> = None;
    let mut seen: Vec<&str> = Vec::new();
    for line in ptx.lines() {
        // llc may put a comment after the closing `)` of the parameter list.
        let t = line.split("//").next().unwrap_or("").trim();
        if let Some(name) = entry_name(t) {
            let spec = table
                .iter()
                .find(|k| k.name == name)
                .ok_or_else(|| format!("kernel `{name}` is in the PTX but not in mkernel_config::KERNELS"))?;
            seen.push(spec.name);
            pending = Some(spec);
        } else if let Some(p) = pending.filter(|_| {
            t.starts_with(".maxntid")
                || t.starts_with(".minnctapersm")
                || t.starts_with(".reqntid")
                || t.starts_with(".maxnreg")
        }) {
            return Err(format!("kernel `{}` already has launch bounds", p.name));
        }
        match (pending, param_block(t)) {
            (Some(_), Some(align)) if align <= PARAM_BLOCK_ALIGN => {
                out.push_str(&line.replacen(
                    &format!(".align {align} .b8"),
                    &format!(".align {PARAM_BLOCK_ALIGN} .b8"),
                    1,
                ));
            }
            _ => out.push_str(line),
        }
        out.push('\n');
        // The parameter list closes with a line holding just `)`; bounds go between it and `{`.
        if let (Some(spec), true) = (pending, t == ")" || t.ends_with("()")) {
            out.push_str(&format!(
                ".maxntid {}, 1, 1\n.minnctapersm {}\n",
                spec.max_threads, spec.min_blocks_per_sm
            ));
            pending = None;
        }
    }
    if let Some(missing) = table.iter().find(|k| !seen.contains(&k.name)) {
        return Err(format!(
            "kernel `{}` is in mkernel_config::KERNELS but not in the PTX (missing #[unsafe(no_mangle)]?)",
            missing.name
        ));
    }
    Ok(rename_internal_funcs(&out))
}

/// Gives every internal (non-`.visible`) `.func` a name that depends only on its order in the
/// PTX. Rust's mangled names embed a hash of the crate's path, which would make the committed
/// PTX differ between checkouts; the functions are internal, so their names are free.
fn rename_internal_funcs(ptx: &str) -> String {
    let mut names: Vec<String> = vec![];
    for line in ptx.lines() {
        let t = line.trim_start();
        if let Some(rest) = t.strip_prefix(".func ") {
            // `.func NAME(` or `.func (.param ...) NAME(`
            let rest = if rest.starts_with('(') {
                rest.split_once(") ").map(|(_, r)| r).unwrap_or(rest)
            } else {
                rest
            };
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '$')
                .collect();
            if !name.is_empty() && !names.contains(&name) {
                names.push(name);
            }
        }
    }
    let mut out = ptx.to_string();
    for (i, name) in names.iter().enumerate() {
        out = replace_word(&out, name, &format!("mk_internal_func_{i}"));
    }
    out
}

/// Replaces `from` where it stands as a whole identifier (parameter names extend it with
/// `_param_N`, which is renamed along since the prefix is the identifier itself).
fn replace_word(s: &str, from: &str, to: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find(from) {
        let before_ok = rest[..at]
            .chars()
            .last()
            .is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_' || c == '$'));
        out.push_str(&rest[..at]);
        out.push_str(if before_ok { to } else { from });
        rest = &rest[at + from.len()..];
    }
    out.push_str(rest);
    out
}

/// The declared alignment of an entry parameter line `.param .align N .b8 NAME[SIZE]`.
fn param_block(line: &str) -> Option<u32> {
    let rest = line.strip_prefix(".param .align ")?;
    let (align, rest) = rest.split_once(' ')?;
    rest.starts_with(".b8 ").then_some(())?;
    align.parse().ok()
}

fn entry_name(line: &str) -> Option<&str> {
    let rest = line
        .strip_prefix(".visible .entry ")
        .or_else(|| line.strip_prefix(".entry "))?;
    Some(rest.split('(').next().unwrap_or(rest).trim())
}

#[cfg(test)]
mod tests {
    use super::*;
    const K: KernelSpec = KernelSpec {
        name: "k",
        max_threads: 384,
        min_blocks_per_sm: 1,
        dynamic_smem: 0,
    };
    const PTX: &str = ".version 8.6\n.visible .entry k(\n\t.param .u64 k_param_0\n)\n{\n\tret;\n}\n";

    #[test]
    fn bounds_are_inserted_after_params() {
        let out = finish_ptx(PTX, &[K]).unwrap();
        assert!(out.contains(")\n.maxntid 384, 1, 1\n.minnctapersm 1\n{"), "{out}");
    }
    #[test]
    fn parameter_blocks_are_aligned_for_tensor_maps() {
        let ptx = ".visible .entry k(\n\t.param .align 8 .b8 k_param_0[480],\n\t.param .u64 .ptr .align 1 k_param_1\n)\n{\n\tret;\n}\n";
        let out = finish_ptx(ptx, &[K]).unwrap();
        assert!(out.contains("\t.param .align 64 .b8 k_param_0[480],\n"), "{out}");
        assert!(out.contains("\t.param .u64 .ptr .align 1 k_param_1\n"), "{out}");
        // Only inside an entry's parameter list.
        let f = ".func _RNCabc_g(\n\t.param .align 8 .b8 _RNCabc_g_param_0[16]\n)\n{\n}\n";
        let out = finish_ptx(&format!("{ptx}{f}"), &[K]).unwrap();
        assert!(
            out.contains(".param .align 8 .b8 mk_internal_func_0_param_0[16]"),
            "{out}"
        );
    }
    #[test]
    fn comment_after_params_is_handled() {
        let ptx = PTX.replace(")\n{", ")                 // @k\n{");
        let out = finish_ptx(&ptx, &[K]).unwrap();
        assert!(out.contains("// @k\n.maxntid 384, 1, 1\n.minnctapersm 1\n{"), "{out}");
    }
    #[test]
    fn internal_functions_get_path_independent_names() {
        let ptx = format!(
            "{PTX}.func _RNCabc123_f(\n\t.param .b64 _RNCabc123_f_param_0\n)\n{{\n}}\n\tcall.uni _RNCabc123_f, (x);\n"
        );
        let out = finish_ptx(&ptx, &[K]).unwrap();
        assert!(!out.contains("_RNCabc123_f"), "{out}");
        assert!(
            out.contains(".func mk_internal_func_0(")
                && out.contains("mk_internal_func_0_param_0")
                && out.contains("call.uni mk_internal_func_0,"),
            "{out}"
        );
    }
    #[test]
    fn unresolved_extern_fails() {
        let ptx = format!("{PTX}.extern .func foo();\n");
        assert!(finish_ptx(&ptx, &[K]).unwrap_err().contains("unresolved"));
    }
    #[test]
    fn table_and_ptx_must_agree() {
        assert!(finish_ptx(PTX, &[]).unwrap_err().contains("not in mkernel_config"));
        let other = KernelSpec { name: "gone", ..K };
        assert!(finish_ptx(PTX, &[K, other]).unwrap_err().contains("not in the PTX"));
    }
}
