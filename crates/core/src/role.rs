//! A path's role (`role:` in a client's path): whether it carries traffic whenever it is up,
//! or only when the others cannot. The client decides it (its configuration, and its data
//! budget: a path whose budget is used up carries only as a backup); the server follows what
//! the client's probes say (`wire::encode_probe_view`).

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Role {
    /// Carries traffic whenever it is up (as its priority and the policy say).
    #[default]
    Primary,
    /// Carries traffic only while no primary path is up.
    Backup,
    /// A backup that also takes what the primary paths cannot carry: while every primary path
    /// that is up has its queue half full or more (`PathLoad::crowded`).
    Overflow,
}

impl Role {
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "primary" => Some(Role::Primary),
            "backup" => Some(Role::Backup),
            "overflow" => Some(Role::Overflow),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Primary => "primary",
            Role::Backup => "backup",
            Role::Overflow => "overflow",
        }
    }

    /// The byte a probe carries it in.
    pub fn to_wire(self) -> u8 {
        match self {
            Role::Primary => 0,
            Role::Backup => 1,
            Role::Overflow => 2,
        }
    }

    pub fn from_wire(b: u8) -> Option<Role> {
        match b {
            0 => Some(Role::Primary),
            1 => Some(Role::Backup),
            2 => Some(Role::Overflow),
            _ => None,
        }
    }

    /// Not a primary: carries only when the primaries cannot.
    pub fn is_backup(self) -> bool {
        self != Role::Primary
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_wire_bytes_round_trip() {
        for r in [Role::Primary, Role::Backup, Role::Overflow] {
            assert_eq!(Role::parse(r.as_str()), Some(r));
            assert_eq!(Role::from_wire(r.to_wire()), Some(r));
        }
        assert_eq!(Role::parse("standby"), None);
        assert_eq!(Role::from_wire(3), None);
    }
}
