/* Ours (not a kernel header): empty on purpose. bcc's helpers.h includes <asm/page.h> for
 * PAGE_SIZE in BPF_RINGBUF_OUTPUT, which the programs do not use; the kernel's header is
 * architecture- and configuration-dependent and pulls in much of the non-UAPI tree. A program
 * that uses BPF_RINGBUF_OUTPUT fails to compile here, by name. */
