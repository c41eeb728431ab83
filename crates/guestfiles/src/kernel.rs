//! The guest kernel's symbols, from the symbol table of its ELF image
//! (`vmlinux`): the VMM finds the kernel's variables and code by name.
//! `None` wherever the name is not there or the image cannot be read as
//! ELF.

use object::{Object, ObjectSection, ObjectSymbol, SymbolKind};

/// The address of the guest kernel's global variable `name`, from the
/// symbol table of its ELF image (`None`: not there, or the image cannot
/// be read as ELF).
pub fn kernel_variable(kernel_image: &[u8], name: &str) -> Option<u64> {
    kernel_symbol(kernel_image, name, &[SymbolKind::Data])
}

/// The address of the guest kernel's code labelled `name` (a function,
/// or a label inside one, which the assembler leaves untyped), as
/// [`kernel_variable`] finds variables.
pub fn kernel_code(kernel_image: &[u8], name: &str) -> Option<u64> {
    use SymbolKind::{Label, Text, Unknown};
    kernel_symbol(kernel_image, name, &[Text, Label, Unknown])
}

/// The address of the first `bytes` (an instruction's encoding) in the
/// guest kernel's code from label `name` on, within `within` bytes.
pub fn kernel_instruction(
    kernel_image: &[u8],
    name: &str,
    bytes: &[u8],
    within: usize,
) -> Option<u64> {
    let start = kernel_code(kernel_image, name)?;
    let file = object::File::parse(kernel_image).ok()?;
    let code = file.sections().find_map(|s| {
        let end = s.address().checked_add(s.size())?;
        if !(s.address()..end).contains(&start) {
            return None;
        }
        let data = s.data().ok()?;
        let from = usize::try_from(start - s.address()).ok()?;
        data.get(from..from.checked_add(within)?.min(data.len()))
    })?;
    code.windows(bytes.len())
        .position(|w| w == bytes)
        .map(|at| start + at as u64)
}

fn kernel_symbol(kernel_image: &[u8], name: &str, kinds: &[SymbolKind]) -> Option<u64> {
    let file = object::File::parse(kernel_image).ok()?;
    file.symbols()
        .find(|s| kinds.contains(&s.kind()) && s.name() == Ok(name))
        .map(|s| s.address())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A global variable of this test binary, found by its unmangled name.
    #[no_mangle]
    static INSIGHT_BOOT_TEST_VARIABLE: u64 = 0x1234_5678;

    #[test]
    fn kernel_variables_are_found_by_name_in_an_elf_symbol_table() {
        let exe = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        let at = kernel_variable(&exe, "INSIGHT_BOOT_TEST_VARIABLE").expect("the variable");
        assert_ne!(at, 0);
        assert_eq!(
            std::hint::black_box(INSIGHT_BOOT_TEST_VARIABLE),
            0x1234_5678
        );
        assert_eq!(kernel_variable(&exe, "insight_no_such_variable"), None);
        // Code is found as code, not as a variable: the label the
        // global_asm! below defines (a Rust function's symbol may be
        // inlined away in an optimised build).
        extern "C" {
            fn insight_boot_test_code();
        }
        let linked = std::hint::black_box(insight_boot_test_code as *const () as usize);
        assert_ne!(linked, 0);
        assert!(kernel_code(&exe, "insight_boot_test_code").is_some_and(|a| a != 0));
        assert_eq!(kernel_variable(&exe, "insight_boot_test_code"), None);
        assert_eq!(kernel_code(&exe, "INSIGHT_BOOT_TEST_VARIABLE"), None);
        assert_eq!(kernel_variable(b"not an ELF image", "anything"), None);
    }

    // A label with known code, as the kernel's entry code has them.
    std::arch::global_asm!(
        ".pushsection .text",
        ".globl insight_boot_test_code",
        "insight_boot_test_code:",
        "nop",
        "nop",
        "swapgs",
        "ret",
        ".popsection",
    );

    #[test]
    fn an_instruction_is_found_in_the_code_after_a_label() {
        extern "C" {
            fn insight_boot_test_code();
        }
        // Referenced, so that the linker keeps it.
        let linked = std::hint::black_box(insight_boot_test_code as *const () as usize);
        assert_ne!(linked, 0);
        let exe = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        let label = kernel_code(&exe, "insight_boot_test_code").expect("the label");
        let swapgs = [0x0f, 0x01, 0xf8];
        assert_eq!(
            kernel_instruction(&exe, "insight_boot_test_code", &swapgs, 16),
            Some(label + 2)
        );
        // Not within the first four bytes, nor after a label that is not
        // there.
        assert_eq!(
            kernel_instruction(&exe, "insight_boot_test_code", &swapgs, 4),
            None
        );
        assert_eq!(
            kernel_instruction(&exe, "insight_no_such_label", &swapgs, 16),
            None
        );
    }
}
