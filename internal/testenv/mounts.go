package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"syscall"
)

// privateMountsEnv marks a test binary re-executed by InPrivateMountNamespace.
const privateMountsEnv = "FTKIT_TEST_PRIVATE_MOUNTS"

// InPrivateMountNamespace re-executes the test binary, as root, in a mount namespace of its own whose mounts
// propagate nowhere (unshare(1), private propagation), for a package whose tests mount file systems: made in
// the host's namespace, a mount reached every lab job's namespace running beside it (a job's namespace
// receives the host's later mounts), and a dump that found it there, and gone from the host by the time it
// looked for it, failed (TestJobSeesLaterHostMounts). Call it first in TestMain. It returns in the
// re-executed binary, and where it cannot re-execute (not root, no unshare), leaving the tests where they are.
func InPrivateMountNamespace() {
	if os.Geteuid() != 0 || os.Getenv(privateMountsEnv) != "" {
		return
	}
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		fmt.Fprintf(os.Stderr, "testenv: no unshare (util-linux): the tests' mounts are made in the host's mount namespace: %v\n", err)
		return
	}
	self, err := os.Executable()
	if err != nil {
		fmt.Fprintf(os.Stderr, "testenv: the tests' mounts are made in the host's mount namespace: %v\n", err)
		return
	}
	argv := append([]string{"unshare", "--mount", "--propagation", "private", "--", self}, os.Args[1:]...)
	err = syscall.Exec(unshare, argv, append(os.Environ(), privateMountsEnv+"=1"))
	fmt.Fprintf(os.Stderr, "testenv: re-execute %s in a mount namespace of its own: %v\n", self, err)
	os.Exit(1)
}
