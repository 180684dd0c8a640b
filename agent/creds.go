package agent

import (
	"fmt"

	"github.com/ftkit/ftkit/criu/image"
)

// checkImageCreds refuses a restore of a job of uid (group gid) from the images in dir that would give a
// thread other credentials than its user's: every uid the job's, every gid its group's, no supplementary
// group and no capability, as the job started (its init drops root's: shim/jobinit.go). CRIU restores each
// thread as root with whatever credentials its images hold: a job caught running a set-uid, set-gid or
// file-capability program (sudo, su, newgrp...) would come back with them, here, where or when its user may
// have no right to them. Checked on the images before anything is restored, not on the restored tree: at
// CRIU's post-restore notification every thread still runs as root, and CRIU gives them their own
// credentials only as they resume. A job of root's is not checked.
func checkImageCreds(dir string, uid, gid uint32) error {
	if uid == 0 {
		return nil
	}
	threads, err := image.Credentials(dir)
	if err != nil {
		return err
	}
	for _, c := range threads {
		if why := foreignCreds(c, uid, gid); why != "" {
			return fmt.Errorf("refused: thread %d of the snapshot %s, not only the job's user's (uid %d, gid %d, no supplementary group, no capability): it ran a set-uid, set-gid or capability program when the snapshot was taken, whose privileges a restore does not hand to the job; restore from another snapshot",
				c.TID, why, uid, gid)
		}
	}
	return nil
}

// foreignCreds says what in c is not user uid's (group gid), "" if nothing.
func foreignCreds(c image.ThreadCreds, uid, gid uint32) string {
	for _, id := range []uint32{c.UID, c.EUID, c.SUID, c.FSUID} {
		if id != uid {
			return fmt.Sprintf("runs as uids %d/%d/%d/%d", c.UID, c.EUID, c.SUID, c.FSUID)
		}
	}
	for _, id := range []uint32{c.GID, c.EGID, c.SGID, c.FSGID} {
		if id != gid {
			return fmt.Sprintf("runs as gids %d/%d/%d/%d", c.GID, c.EGID, c.SGID, c.FSGID)
		}
	}
	if len(c.Groups) > 0 {
		return fmt.Sprintf("has supplementary groups %v", c.Groups)
	}
	// Inheritable ones too: a program with those file capabilities gains them (the job starts with none,
	// shim/jobinit.go).
	for _, set := range [][]uint32{c.CapPrm, c.CapEff, c.CapInh} {
		for _, w := range set {
			if w != 0 {
				return fmt.Sprintf("holds capabilities (permitted %x, effective %x, inheritable %x)", c.CapPrm, c.CapEff, c.CapInh)
			}
		}
	}
	return ""
}
