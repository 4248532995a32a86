/* Ours (not a kernel header). bcc force-includes ./include/linux/kconfig.h from the tree it
 * compiles against (-include, before everything else), and its helpers.h refuses to compile
 * without CONFIG_BPF_SYSCALL. The kernel's kconfig.h pulls in the build's autoconf.h; the
 * programs read no other CONFIG_ option, so this is the one definition they need. */
#ifndef RDR_KCONFIG_H
#define RDR_KCONFIG_H
#define CONFIG_BPF_SYSCALL 1
#endif
